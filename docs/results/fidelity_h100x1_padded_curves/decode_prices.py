#!/usr/bin/env python3
"""A fidelity run's measured decode steps against two prices from the run's own curves: at the
step's own batch (linear in log2(batch) between the measured points, then linear in the context,
as serving/step_curves.hpp interpolates) and at its CUDA-graph bucket. Prints the sums' ratios
overall and per bucket, and per batch with --by-batch.

  decode_prices.py <folder with log.txt and fidelity_steps.csv.gz> <P> [--by-batch] [--buckets-only]

--buckets-only: use only the curve points at the buckets (as every run before the points past
the buckets), so a run with both kinds of points can be priced both ways."""
import collections, csv, gzip, math, re, sys

folder, P = sys.argv[1], int(sys.argv[2])
buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
curves = collections.defaultdict(dict)  # mode -> context -> {batch: ms}
for line in open(folder + '/log.txt'):
    m = re.match(r'\s*curve (\S+): context\s+(\d+) batch\s+(\d+):\s+([\d.]+) ms', line)
    if not m:
        continue
    mode, ctx, b, ms = m[1], int(m[2]), int(m[3]), float(m[4])
    ranks = P if mode == 'EP' else 1
    if '--buckets-only' in sys.argv and (b % ranks or b // ranks not in buckets):
        continue
    curves[mode].setdefault(ctx, {})[b] = ms
if P == 1:
    curves['TP'] = curves['EP']  # at P = 1 EP's points stand for TP's


def row_ms(row, b):
    bs = sorted(row)
    if b <= bs[0]:
        return row[bs[0]]
    for b0, b1 in zip(bs, bs[1:]):
        if b <= b1:
            t = (math.log2(b) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return row[b0] + (row[b1] - row[b0]) * t
    b0, b1 = bs[-2], bs[-1]
    return row[b1] + (row[b1] - row[b0]) / (b1 - b0) * (b - b1)


def step_ms(mode, b, c):
    rows = curves[mode]
    cs = sorted(rows)
    if c <= cs[0]:
        return row_ms(rows[cs[0]], b)
    for c0, c1 in zip(cs, cs[1:]):
        if c <= c1:
            y0, y1 = row_ms(rows[c0], b), row_ms(rows[c1], b)
            return y0 + (y1 - y0) * (c - c0) / (c1 - c0)
    return row_ms(rows[cs[-1]], b)


def bucket(b):
    return next((x for x in buckets if x >= b), b)


total = collections.defaultdict(float)
per_bucket = collections.defaultdict(lambda: collections.defaultdict(float))
per_batch = collections.defaultdict(lambda: collections.defaultdict(float))
with gzip.open(folder + '/fidelity_steps.csv.gz', 'rt') as f:
    for r in csv.DictReader(f):
        if not r['run'].startswith('GPU') or int(r['prefill_tokens']) != 0:
            continue
        mode, B = r['config'], int(r['sequences'])
        ctx = int(r['context_tokens']) / B
        # A rank's batch: TP attention runs every sequence, EP each rank about B / P.
        ranks = P if mode == 'EP' else 1
        rank_batch = math.ceil(B / ranks)
        prices = {'measured': float(r['measured_ms']),
                  'own': step_ms(mode, ranks * rank_batch, ctx),
                  'bucket': step_ms(mode, ranks * bucket(rank_batch), ctx)}
        for k, v in prices.items():
            total[k] += v
            per_bucket[bucket(rank_batch)][k] += v
            per_batch[rank_batch][k] += v
        per_batch[rank_batch]['n'] += 1
print('decode steps, priced / measured: own batch %.4f, bucket %.4f'
      % (total['own'] / total['measured'], total['bucket'] / total['measured']))
for b in sorted(per_bucket):
    t = per_bucket[b]
    print('  bucket %4d: %8.1f ms measured, own %.3f, bucket %.3f'
          % (b, t['measured'], t['own'] / t['measured'], t['bucket'] / t['measured']))
if '--by-batch' in sys.argv:
    for b in sorted(per_batch):
        t = per_batch[b]
        if t['n'] >= 20:
            print('  batch %4d: %4d steps, %6.3f ms each, own %.3f, bucket %.3f'
                  % (b, t['n'], t['measured'] / t['n'], t['own'] / t['measured'],
                     t['bucket'] / t['measured']))
