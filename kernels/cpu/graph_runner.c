// A captured graph's kernel calls made from C (kernels/cpu_graph.py): one ctypes call a
// replay instead of ~300, each of which built its arguments in Python (~1.8 us a call with
// 18 arguments, ~0.5 ms a decode step on the 2-core Xeon).
//
// Every kernel takes int64 and pointer arguments and float scalars, and returns an int status.
// Each is called through one type of RUNNER_INTS int64s then RUNNER_FLOATS floats: on the
// x86-64 System V and AArch64 ABIs integer and float arguments take their own registers in
// order, and integer ones past the registers go to the stack in order, so a kernel's k-th
// integer argument is the k-th int64 here and its k-th float the k-th float, whatever its
// own order of the two; the arguments it does not take are ignored (the caller pops them).
// kernels/cpu_graph.py uses this only on those ABIs, and only for calls that fit.
#include <stdint.h>

#define RUNNER_INTS 20
#define RUNNER_FLOATS 4

typedef struct {
    const void *fn;
    int64_t status;  // what the call returned at capture
    int64_t ints[RUNNER_INTS];
    float floats[RUNNER_FLOATS];
} recorded_call;

typedef int (*any_kernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                          float, float);

// the calls in order; -1 when each returned its captured status, else the first one that did
// not (the calls after it are not made)
int run_calls(const recorded_call *calls, int64_t num_calls) {
    for (int i = 0; i < num_calls; i++) {
        const recorded_call *c = &calls[i];
        const int64_t *a = c->ints;
        const float *f = c->floats;
        const int status = ((any_kernel)c->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                               a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                                               a[15], a[16], a[17], a[18], a[19], f[0], f[1],
                                               f[2], f[3]);
        if (status != c->status) return i;
    }
    return -1;
}
