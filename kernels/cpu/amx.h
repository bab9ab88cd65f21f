// What every AMX kernel needs (kernels/cpu/paged_tiles.c's tiles_amx.h, amx_linear.c): the
// tile configuration's layout and the process's permission to use the tile registers.
#ifndef KVPAGER_AMX_H
#define KVPAGER_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Linux hands out the tile registers' state only to a process that asks for it.
int tiles_ready(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

#endif
