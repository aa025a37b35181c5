#!/bin/bash
# The five runs behind results/*.json, from the repo root, one after another (one process, one thread).
# 2026-12-01, 2-core CPU VM shared with other work (load 3.3-6.8 during the runs).
set -e
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
S=research/speed_levers/speed_levers.py
O=research/speed_levers/results
run() { out=$1; shift; V=(); for v in "${@:3}"; do V+=(--variant "$v"); done; python -W ignore $S $1 $2 "${V[@]}" --out $O/$out; }

# 1. small -> large: per-layer ablation of the residual readers, rank, shared rank, key-space lags, lags, source inputs, J=2
run s2l_main.json "--source small --target large" "" 'full:' 'kv_only:res=none' 'only2:res=2' 'only3:res=3' 'only4:res=4' \
  'only5:res=5' 'only6:res=6' 'only7:res=7' 'no2:res=3,4,5,6,7' 'no3:res=2,4,5,6,7' 'no4:res=2,3,5,6,7' 'no5:res=2,3,4,6,7' \
  'no6:res=2,3,4,5,7' 'no7:res=2,3,4,5,6' 'r23:res=2,3' 'r234:res=2,3,4' 'r34:res=3,4' 'rank8:rank=8' 'rank16:rank=16' \
  'rank32:rank=32' 'rank64:rank=64' 'srank16:srank=16' 'srank32:srank=32' 'srank64:srank=64' 'srank128:srank=128' \
  'own_keyspace:own=1' 'lags01:lags=0,1' 'lags0123:lags=0,1,2,3' 'res_alone:nosrc=res' 'r23_res_alone:res=2,3;nosrc=2,3' \
  'r23_src3:res=2,3;src=3' 'r23_src23:res=2,3;src=2,3' 'r23_srank32:res=2,3;srank=32' 'r23_srank64:res=2,3;srank=64' \
  'r23_rank32:res=2,3;rank=32' 'J2_full:J=2' 'J2_kv:J=2;res=none'
# 2. small -> large: cheap configurations around the copy layer 3
run s2l_cheap.json "--source small --target large" "" 'full:' 'r3:res=3' 'r3_rank64:res=3;rank=64' 'r3_rank32:res=3;rank=32' \
  'r3_rank16:res=3;rank=16' 'r3_res_alone:res=3;nosrc=3' 'r3_src3:res=3;src=3' 'r3_src23:res=3;src=2,3' 'r3_lags01:res=3;lags=0,1' \
  'r35:res=3,5' 'r3_zero_rest:res=3;zero=2,4,5,6,7' 'r3_plain_rest:res=3;plain=2,4,5,6,7' \
  'r3_alone_zero_rest:res=3;nosrc=3;zero=2,4,5,6,7' 'r3_alone_zero_rest_rank32:res=3;nosrc=3;zero=2,4,5,6,7;rank=32' \
  'r3_zero_rest_src3:res=3;zero=2,4,5,6,7;src=3' 'r3_rank32_src3:res=3;rank=32;src=3' 'r3_zero47:res=3;zero=4,5,6,7' \
  'r23_zero_rest:res=2,3;zero=4,5,6,7'
# 3. large -> small
run l2s.json "--source large --target small" "" 'full:' 'kv_only:res=none' 'only2:res=2' 'only3:res=3' 'rank8:rank=8' \
  'rank16:rank=16' 'rank32:rank=32' 'srank16:srank=16' 'srank32:srank=32' 'own_keyspace:own=1' 'lags01:lags=0,1' \
  'res_alone:nosrc=res' 'src7:src=7' 'src67:src=6,7' 'src4567:src=4,5,6,7' 'src1357:src=1,3,5,7' 'only3_src7:res=3;src=7' \
  'res_alone_zero2:res=3;nosrc=3;zero=2' 'zero2:res=3;zero=2' 'src67_rank32:src=6,7;rank=32' 'J2_full:J=2' \
  'J2_kv:J=2;res=none' 'J2_res_alone:J=2;nosrc=res' 'J2_src7:J=2;src=7'
# 4-5. the candidates again with more interleaved TTFT repeats
run s2l_final.json "--source small --target large" "--ttft-repeats 15" 'full:' 'kv_only:res=none' 'r3_src3:res=3;src=3' \
  'r3_rank32_src3:res=3;rank=32;src=3' 'r3_rank32_src3_zero47:res=3;rank=32;src=3;zero=4,5,6,7' \
  'r3_src3_zero47:res=3;src=3;zero=4,5,6,7'
run l2s_final.json "--source large --target small" "--ttft-repeats 25" 'full:' 'kv_only:res=none' 'src7:src=7' \
  'res_alone:nosrc=res' 'res_alone_zero2:res=3;nosrc=3;zero=2' 'res_alone_zero2_rank32:res=3;nosrc=3;zero=2;rank=32' \
  'J2_res_alone:J=2;nosrc=res'
python research/speed_levers/table.py $O/*.json > research/speed_levers/all_rows.md
