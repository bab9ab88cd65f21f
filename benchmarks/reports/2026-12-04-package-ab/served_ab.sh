#!/usr/bin/env bash
# $1: label, $2: venv dir, then serve args
label=$1; venv=$2; shift 2
cd /tmp/abrun && . $venv/bin/activate
kvpager serve "$@" > /tmp/abrun/serve-$label.log 2>&1 &
pid=$!
for i in $(seq 120); do grep -q "kvpager: ready" /tmp/abrun/serve-$label.log && break; sleep 1; done
. /work/main/.venv/bin/activate
timeout 400 kvpager bench serve --base-url http://127.0.0.1:8000 --tokenizer /root/.cache/kvpager/models/smollm2-135m-instruct --num-prompts 48 --input-len 256 --output-len 64 --max-concurrency 16 2>&1 | tail -22 > /tmp/abrun/bench-$label.txt
kill -INT $pid; wait $pid 2>/dev/null
pkill -f "kvpager serve" ; sleep 2
