#!/bin/bash
# An interrupted default fit resumed: Ctrl-C (SIGINT) once the configuration probe has scored its 6th candidate.
cd "$(dirname "$0")/../.."
LOGS=${2:?usage: resume_probe.sh OUT_DIR LOG_DIR}; mkdir -p $LOGS
OUT=${1:?usage: resume_probe.sh OUT_DIR LOG_DIR}
rm -rf $OUT $(dirname $OUT)/.$(basename $OUT).fit-checkpoint
CMD="hf-kvtransfer fit -v --source examples/family/small --target examples/family/large --dataset examples/family/calibration.txt --output $OUT"
# Background jobs of a non-interactive shell ignore SIGINT; exec the fit with the default handler, as a terminal would.
uptime > $LOGS/uptime_start.txt
( /usr/bin/time -v python -c 'import os,signal,sys;signal.signal(signal.SIGINT,signal.SIG_DFL);os.execvp(sys.argv[1],sys.argv[1:])' $CMD ) > $LOGS/interrupted.log 2>&1 &
sleep 5
while pgrep -f "bin/hf-kvtransfer fit -v --source examples/family/small" > /dev/null; do
  if tr '\r' '\n' < $LOGS/interrupted.log | grep -q "configuration probe, candidate 6 of"; then
    kill -INT $(pgrep -f "bin/hf-kvtransfer fit -v --source examples/family/small"); break
  fi
  sleep 2
done
wait; echo "done" >> $LOGS/interrupted.log
ls -la $(dirname $OUT)/.$(basename $OUT).fit-checkpoint >> $LOGS/interrupted.log
( /usr/bin/time -v $CMD ) > $LOGS/resumed.log 2>&1
echo "rc $?" >> $LOGS/resumed.log
uptime > $LOGS/uptime_end.txt
