// AMX's tile state, for the kernels that use the tile unit (rows_gemm_amx.c, qgemm_amx.c).
#ifndef UPESI_AMX_H
#define UPESI_AMX_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Asks the kernel for the AMX tile state (once per process is enough). Returns 0 when AMX may be used.
static inline int amx_request(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

// LDTILECFG's 64-byte operand: palette 1, each tile's rows and bytes per row.
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;
#endif
