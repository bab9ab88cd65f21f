// Work a team splits into contiguous runs, one a thread, where a thread done with its own run
// takes what is left of the others' from their backs (kernels/cpu/paged_tiles.c,
// amx_linear.c). On a small host another process often holds a core for a while: with a
// static split the whole team then waits at the region's end for that thread's share; here
// it waits for the one item the thread had started.
#ifndef KVPAGER_STEAL_H
#define KVPAGER_STEAL_H

#include <stdint.h>

#define MAX_RUNS 256  // a step's team; more threads than this are not asked for

// A run [front, back) in one word: its owner takes from the front, others from the back, and
// one compare-and-swap keeps them from taking the same item. A cache line each, so owners
// taking from their own runs do not pass a line between cores.
typedef struct {
    uint64_t word;
    char pad[56];
} __attribute__((aligned(64))) run;

static inline run run_of(uint64_t front, uint64_t back) { return (run){front << 32 | back, {0}}; }

// The next item of `r` (its front, or its back for a thread taking another's), or -1.
static inline int64_t take(run *r, int from_back) {
    uint64_t *word = &r->word;
    uint64_t old = __atomic_load_n(word, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = old >> 32, back = old & 0xffffffffu;
        if (front >= back) return -1;
        const uint64_t left = from_back ? front << 32 | (back - 1) : (front + 1) << 32 | back;
        if (__atomic_compare_exchange_n(word, &old, left, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return from_back ? (int64_t)back - 1 : (int64_t)front;
    }
}

// The calling thread's next item: from the front of its own run `me`, then from the backs of
// the others' in turn; `*k` counts the runs done with (0 to start), so run (me + *k) % threads
// holds the item returned. -1 when no run has any left.
static inline int64_t next_item(run *runs, int64_t threads, int64_t me, int64_t *k) {
    for (; *k < threads; ++*k) {
        const int64_t item = take(&runs[(me + *k) % threads], *k > 0);
        if (item >= 0) return item;
    }
    return -1;
}

// Threads to ask for: at least 1, at most MAX_RUNS.
static inline int64_t team_size(int64_t num_threads) {
    return num_threads < 1 ? 1 : num_threads > MAX_RUNS ? MAX_RUNS : num_threads;
}

#endif
