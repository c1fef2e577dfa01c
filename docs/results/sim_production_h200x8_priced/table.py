import json, sys
def load(f): return {r['run']: r for r in json.load(open(f))}
v, s = load(sys.argv[1]), load(sys.argv[2])
label = {'ours': 'ours (the paper\'s design)', 'ours DCP2': 'ours DCP2 (EP ↔ TP-DCP2)',
         'ours experts': 'ours experts (TEP-DCP2 ↔ TP-DCP2)', 'ours dcp': 'ours dcp (TP-DCP2 ↔ TP)'}
def cells(r):
    a = r['all']
    sw = ', %d switches (%.0f ms)' % (r['switches'], r['switch_total_ms']) if r['switches'] else ''
    return '%.2f / %.2f s | %.1f / %.1f ms%s | %.0f' % (a['mean_ttft_ms']/1e3, a['p99_ttft_ms']/1e3, a['mean_tpot_ms'], a['p99_tpot_ms'], sw, r['tokens_per_s'])
print('| run | vLLM: TTFT mean / p99 | vLLM: TPOT mean / p99 | vLLM: tokens/s | SGLang: TTFT mean / p99 | SGLang: TPOT mean / p99 | SGLang: tokens/s |')
print('|---|---|---|---|---|---|---|')
for k in v:
    if k in ('ours progressive', 'ours by cost'): continue
    print('| %s | %s | %s |' % (label.get(k, k), cells(v[k]), cells(s[k])))
