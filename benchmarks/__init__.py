"""Developer benchmarks by topic (peers, serving, engine, kernels, gpu), each run as
`python -m benchmarks.<topic>.<name>`; `kvpager bench` is the installed one."""
