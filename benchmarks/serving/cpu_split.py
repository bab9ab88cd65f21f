"""Where a served run's CPU time went: seconds of CPU per process of the server's tree (the
executor, scheduler, tokenizer, gateway and nats-server; vLLM's API server and engine core),
counted from before a run to after it. On a 2-core host every second the services spend is a
second the model's threads do not get."""

import psutil


def label(process: psutil.Process) -> str:
    """A process's role: the `kvpager <service>` it runs, else its name (vLLM titles its
    engine core process `VLLM::EngineCore`)."""
    try:
        name, cmdline = process.name(), process.cmdline()
    except psutil.Error:
        return "gone"
    for role in ("executor", "scheduler", "tokenizer", "http", "serve"):
        if role in cmdline[1:]:
            return role
    return name


def cpu_seconds(pid: int) -> dict[str, float]:
    """User plus system CPU seconds of `pid` and everything under it, by role."""
    seconds: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return seconds
    for process in tree:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        role = label(process)
        seconds[role] = seconds.get(role, 0.0) + times.user + times.system
    return seconds


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: after[role] - before.get(role, 0.0) for role in after}


def describe(seconds: dict[str, float], wall_s: float) -> str:
    """The total, then `role seconds` for each role, the largest first."""
    total = sum(seconds.values())
    parts = [f"{role} {s:.1f}" for role, s in sorted(seconds.items(), key=lambda kv: -kv[1])]
    return f"CPU s in {wall_s:.1f} s wall: total {total:.1f}; " + ", ".join(parts)
