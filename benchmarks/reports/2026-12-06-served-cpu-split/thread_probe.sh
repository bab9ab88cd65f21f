#!/bin/bash
# kvpager serve fp32 + vllm bench client random 256/128 x64 at inf; py-spy on the executor; stats after
set -e
cd /work/main
. .venv/bin/activate
HP=18123; NP=14333
OMP_NUM_THREADS=2 python -m kvpager.services.cli serve --model /root/.cache/kvpager/models/smollm2-135m-instruct --dtype float32 --http-port $HP --nats-port $NP --served-model-name bench-model --max-num-seqs 64 --max-model-len 2048 --kv-cache-memory $((4<<30)) --log-level warning > /tmp/probe-server.log 2>&1 &
SP=$!
for i in $(seq 300); do curl -s localhost:$HP/health >/dev/null && break; sleep 1; done
B="/tmp/vllm-venv/bin/python benchmarks/peers/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:$HP --endpoint /v1/completions --model bench-model --tokenizer /root/.cache/kvpager/models/smollm2-135m-instruct --dataset-name random --random-input-len 256 --random-output-len 128 --request-rate inf --max-concurrency 64 --ignore-eos --seed 0"
$B --num-prompts 8 > /tmp/probe-warm.log 2>&1
EX=$(pgrep -f "kvpager.services.cli executor" | head -1)
echo executor $EX
curl -s localhost:$HP/metrics > /tmp/probe-metrics-before.txt
for t in /proc/$EX/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(cut -d' ' -f14,15 $t/stat)"; done > /tmp/probe-threads-before.txt
$B --num-prompts 64 > /tmp/probe-run.log 2>&1
for t in /proc/$EX/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(cut -d' ' -f14,15 $t/stat)"; done > /tmp/probe-threads-after.txt
curl -s localhost:$HP/metrics > /tmp/probe-metrics-after.txt
python -m kvpager.services.cli stats --nats-url nats://127.0.0.1:$NP > /tmp/probe-stats.txt 2>&1 || true
sleep 2
kill -INT $SP; wait $SP || true
grep -E "Output token throughput|Mean TTFT" /tmp/probe-run.log
