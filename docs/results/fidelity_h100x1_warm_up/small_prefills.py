#!/usr/bin/env python3
"""The measured run's steps that prefill fewer tokens than the step's 512-token budget, each
against the mixed-step grid the same run measured (bilinear in log2(decodes + 1), log2(prefill
tokens), as serving/mixed_step_table.hpp prices them, without its context correction): measured
/ grid, grouped. Usage: small_prefills.py <folder with fidelity.json and fidelity_steps.csv[.gz]>
"""
import gzip, os
import csv,json,math,statistics as st,sys
f=sys.argv[1]
path=f+'/fidelity_steps.csv'
lines=open(path) if os.path.exists(path) else gzip.open(path+'.gz','rt')
rows=[r for r in csv.DictReader(lines) if r['run'].startswith('GPU')]
d=json.load(open(f+'/fidelity.json'))
grid={}
for g in d['mixed_grid']: grid.setdefault(g['decode_batch'],[]).append((g['chunk_tokens'],g['step_ms']))
bs=sorted(grid)
def row(b,t):
  pts=sorted(grid[b])
  if t<=pts[0][0]: return pts[0][1]
  for (t0,m0),(t1,m1) in zip(pts,pts[1:]):
    if t<=t1:
      f=(math.log2(t)-math.log2(t0))/(math.log2(t1)-math.log2(t0)); return m0+f*(m1-m0)
  (t0,m0),(t1,m1)=pts[-2],pts[-1]; return m1+(t-t1)*(m1-m0)/(t1-t0)
def G(b,t):
  b=min(b,bs[-1])
  for b0,b1 in zip(bs,bs[1:]):
    if b<=b1:
      f=(math.log2(b+1)-math.log2(b0+1))/(math.log2(b1+1)-math.log2(b0+1)); return row(b0,t)+f*(row(b1,t)-row(b0,t))
seen=set();out=[]
prev=None
for r in rows:
  pf=int(r['prefill_tokens']);dec=int(r['decode_tokens']);M=pf+dec
  if pf>0 and M<512:
    k=int(r['sequences'])-dec
    out.append(dict(step=int(r['step']),ratio=float(r['measured_ms'])/G(dec,pf),new=M not in seen,dec=dec,pf=pf,k=k,prevpf=prev is not None and int(prev['prefill_tokens'])>0, ms=float(r['measured_ms'])))
  if pf>0: seen.add(M)
  prev=r
def summ(name,L):
  if L: print(f"{name:40s} n={len(L):3d} median {st.median([x['ratio'] for x in L]):.3f} mean {st.mean([x['ratio'] for x in L]):.3f}")
summ('all small',out)
summ('first half of run',[x for x in out if x['step']<len(rows)/2])
summ('second half',[x for x in out if x['step']>=len(rows)/2])
summ('rows first seen',[x for x in out if x['new']])
summ('rows seen before',[x for x in out if not x['new']])
summ('after a prefill step',[x for x in out if x['prevpf']])
summ('after a decode step',[x for x in out if not x['prevpf']])
summ('dec<8',[x for x in out if x['dec']<8]); summ('dec>=8',[x for x in out if x['dec']>=8])
summ('pf<128',[x for x in out if x['pf']<128]); summ('pf>=128',[x for x in out if x['pf']>=128])
