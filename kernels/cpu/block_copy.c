// Whole KV blocks moved between host caches as runs of memcpy: the CPU pool's swaps and a disk
// file's block landing in the CPU pool. Its twin is kernels/reference.py's swap_blocks_ref (an
// index_put); kernels/cpu_block_ops.py keeps torch slice copies where this is not built.
//
// Why: a cache is [layers * 2 rows, blocks, block bytes], so one block is `num_rows` pieces of
// a few KiB, one a row. torch's copy of such a block from a disk reader thread starts an
// OpenMP team of its own beside the step's (two readers on a 2-core host: six threads), and
// its scattered swaps cost a strided copy call a block. Rough numbers from a loaded 2-core AMD
// EPYC (benchmarks/kernels/tier_reads.py has the paths): a block landing from a reader thread,
// 2.4-6 GB/s here against 0.2-1.1 for torch; swaps of scattered blocks 7-10 GB per CPU-second
// against 1.5-5, consecutive ones 10-11 against 7-9.
//
// runs: num_runs x (src block, dst block, length), the blocks already checked in range by the
// caller; rows split over num_threads (1 from a reader thread: the disk's threads split files).

#include <stdint.h>
#include <string.h>

int copy_block_runs(char *dst, int64_t dst_row_stride, const char *src, int64_t src_row_stride,
                    int64_t num_rows, int64_t block_bytes, const int64_t *runs,
                    int64_t num_runs, int64_t num_threads) {
    if (num_rows < 0 || block_bytes < 0 || num_runs < 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t row = 0; row < num_rows; row++) {
        char *dst_row = dst + row * dst_row_stride;
        const char *src_row = src + row * src_row_stride;
        for (int64_t i = 0; i < num_runs; i++) {
            const int64_t *run = runs + 3 * i;
            memcpy(dst_row + run[1] * block_bytes, src_row + run[0] * block_bytes,
                   (size_t)(run[2] * block_bytes));
        }
    }
    return 0;
}
