set -u
BUNDLE=.gpu; source scripts/gpu-bundle-env.sh
M=/tmp/ll-new/ep16-rank; mkdir -p /tmp/sc /tmp/oldb
[[ -f $M/config.json ]] || "$BG" make-random --arch kimi_k3 --preset ep16-rank --out "$M" --shards 8 > $OUT/mr.log 2>&1
xz -dc .gpu/batchgen-old.xz > /tmp/oldb/batchgen && chmod +x /tmp/oldb/batchgen
ids=$(python3 -c "import random; r=random.Random(5); print(','.join(str(r.randrange(1000, 150000)) for _ in range(64)))")
gen=5861,127464,60504,28277,95939,79467,79463,76062,113174,73284,124289,43266,141065,127871,48882,126807,118496,103954,140438,90862,72971,82730,126688,30355,44761,41744,124646,34940,35028,60936,124625,21871,122364,110024,140148,45498,138836,54971
pin() { BG_LINEAR_GROUPS=0 BG_MOE_W4A16=0 BG_MOE_FFN_PATH=tiled BG_MOE_GROUPED_MIN_ROWS=1000000000 "$@"; }
pin $BG score --device cuda --model $M --tokens "$ids,$gen" --prefill 64 --out /tmp/sc/one.safetensors 2> $OUT/one.err; echo "one rc=$?" >> $OUT/summary.txt
pin $BG score --device cuda --model $M --tokens "$ids,$gen" --prefill 64 --out /tmp/sc/ll2.safetensors --ep 2 --k3-moe-exchange ll 2> $OUT/ll2.err; echo "ll2 rc=$?" >> $OUT/summary.txt
pin $BG score --device cuda --model $M --tokens "$ids,$gen" --prefill 64 --out /tmp/sc/ll4.safetensors --ep 4 --k3-moe-exchange ll 2> $OUT/ll4.err; echo "ll4 rc=$?" >> $OUT/summary.txt
PYB=/opt/torch/.venv/bin/python3; [[ -x $PYB ]] || PYB=python3; $PYB - /tmp/sc <<'PY' >> $OUT/summary.txt
import json, struct, sys, numpy as np
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); t=h['logits']
    s,e=t['data_offsets']; return np.frombuffer(b[8+n+s:8+n+e],dtype=np.float32).reshape(t['shape'])
o=sys.argv[1]
for base, other in [('one','ll2'),('one','ll4')]:
    a=load(o+'/'+base+'.safetensors'); b=load(o+'/'+other+'.safetensors')
    rows=[i for i in range(a.shape[0]) if not np.array_equal(a[i].view(np.uint32),b[i].view(np.uint32))]
    print(base, other, 'shape', a.shape, 'rows differing', len(rows), 'first', rows[:8], 'max abs', float(np.abs(a-b).max()))
PY
for b in /tmp/oldb/batchgen $BG; do
  $b bench prefill --device cuda --model $M --prefill-tokens 8192 --prefill-chunk 8192 2>&1 | grep "device memory at its peak" | sed "s|^|$b: |" >> $OUT/summary.txt
done
