# The design's worst metric against the best static configuration on each metric (as is).
import json, sys
STATIC = ['static TP', 'static EP', 'static TP-DCP2', 'static TEP-DCP2']
METRICS = [  # (name, getter, lower is better)
    ('flood TTFT mean', lambda r: r['flood']['mean_ttft_ms'] / 1e3, True),
    ('flood TTFT p99', lambda r: r['flood']['p99_ttft_ms'] / 1e3, True),
    ('quiet TPOT mean', lambda r: r['quiet']['mean_tpot_ms'], True),
    ('quiet TPOT p99', lambda r: r['quiet']['p99_tpot_ms'], True),
    ('TTFT mean', lambda r: r['all']['mean_ttft_ms'] / 1e3, True),
    ('TTFT p99', lambda r: r['all']['p99_ttft_ms'] / 1e3, True),
    ('TPOT mean', lambda r: r['all']['mean_tpot_ms'], True),
    ('TPOT p99', lambda r: r['all']['p99_tpot_ms'], True),
    ('tokens/s', lambda r: r['tokens_per_s'], False),
    ('interactive goodput', lambda r: r['goodput_interactive_rps'], False),
]
runs = {r['run']: r for r in json.load(open(sys.argv[1]))}
print('run | ' + ' | '.join(m[0] for m in METRICS) + ' | switches | end s')
for name, r in runs.items():
    print(name, '|', ' | '.join('%.2f' % g(r) for _, g, _ in METRICS), '|', r['switches'], '(%.0f ms)' % r['switch_total_ms'], '| %.0f' % r['end_s'])
for design in sys.argv[2:] or ['ours dcp', 'ours']:
    worst = None
    for m, g, low in METRICS:
        vals = {s: g(runs[s]) for s in STATIC}
        best = (min if low else max)(vals, key=vals.get)
        b, o = vals[best], g(runs[design])
        if b == 0 and o == 0: continue
        worse = (o / b - 1) if low else (b / o - 1 if o > 0 else float('inf'))
        if worst is None or worse > worst[0]: worst = (worse, m, best, b, o)
    print('%s worst: %s best static %s %.4g, design %.4g: %+.2f%%' % (design, worst[1], worst[2], worst[3], worst[4], 100 * worst[0]))
