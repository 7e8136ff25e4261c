// The CPU emulator's runtime: what the host versions of the kernels' instruction wrappers
// (emu.h) call. One CTA at a time runs on one OS thread; each of its CUDA threads is a fiber
// with its own stack, and a seeded scheduler switches fibers at every synchronising or
// asynchronous primitive, so different seeds give different legal interleavings. Asynchronous
// work (TMA copies, wgmma execution, cp.async copies) lands at scheduler-chosen later points.
// Every rule the emulator checks fails the run with a diagnosis (emu::fail); a run where every
// fiber is blocked is diagnosed as a deadlock, per warp, and fails, never hangs.
//
// Semantics are modelled from the PTX ISA 9.0 and the CUDA driver API documentation; layouts come
// only from sm80_layouts.h, sm90_layouts.h and sm100_layouts.h. The implementation is runtime/, one
// job per file (runtime/state.h holds the state and helpers they share; every .cpp there is built
// into the runtime):
//   scheduler.cpp      fibers and their x86-64 context switch, the seeded scheduler, landing
//                      asynchronous work at random steps
//   diagnostics.cpp    emu::fail with the thread's symbolised call stack, the deadlock report, the
//                      SIGSEGV/SIGBUS handler
//   smem_tracking.cpp  shared-memory range checks; happens-before of asynchronous writes and of
//                      ordinary stores (write-protected window); fence.proxy.async
//   sync.cpp           __syncthreads, bar.sync/bar.arrive, warp collectives, setmaxnreg
//   mbarrier.cpp       mbarrier init, arrivals, phases, try_wait
//   async_copy.cpp     cp.async and TMA loads
//   tensor_map.cpp     the tensor-map encoding (cuTensorMapEncodeTiled's checks) and decoding
//   mma.cpp            ldmatrix.x4 and mma.sync.m16n8k16
//   wgmma.cpp          wgmma issue, execution, retirement
//   tcgen05.cpp        tensor memory, UMMA, tcgen05.commit/ld/st
//   launch.cpp         launch over the grid and the end-of-CTA checks, threadIdx/blockIdx,
//                      stateless instructions, the kernel registry
//
// Threads and scheduling. One CTA runs at a time on the calling OS thread; each CUDA thread is a
// fiber (own mmap'ed stack with a guard page, x86-64 context switch). Every emulated
// primitive is a scheduling point: the fiber returns to the scheduler, which picks the next
// runnable fiber at random (seeded; a per-seed "stay" probability keeps some runs long) and, at
// every step, may complete asynchronous work that is in flight (a per-seed probability: from
// "land at once" to "land as late as possible"): TMA boxes, wgmma instructions, cp.async copies.
// A fiber that must wait blocks on a wait list and is woken when the state it waits for changes.
// When no fiber can run and no asynchronous work is left, the run is a deadlock: every warp's
// state is printed and the run fails.
//
// Checks (each fails the run with a message naming the thread, the object and the call stack):
//  shared memory  accesses through wgmma/TMA/ldmatrix/cp.async/mbarrier outside the dynamic
//                 allocation; the redzone after it overwritten; generic pointers that are not
//                 shared memory; wgmma reading bytes that ordinary stores changed after the last
//                 fence.proxy.async (approximation: one snapshot per fence of any thread).
//  barriers       __syncthreads / bar.sync / bar.arrive: one count per barrier phase, no thread
//                 arriving twice in a phase, whole warps only, nothing pending at exit;
//                 __syncthreads after a thread of the CTA exited.
//  warp collectives (shfl, ldmatrix, mma.sync, __syncwarp, elect.sync): full mask, every lane
//                 executes the same operation.
//  mbarrier       use before init, init twice, use by the async proxy before fence.mbarrier_init,
//                 the 8 bytes overwritten by ordinary stores or TMA, arrival underflow (an
//                 arrival when the phase has all its arrivals and waits for bytes), a TMA copy
//                 completing in a later phase than the one it was issued in (expect_tx too
//                 small), phases left incomplete (arrivals or tx bytes) at exit.
//  TMA            tensor map decoded (bad map: fail), destination 128-byte aligned and inside
//                 the allocation, box written at a scheduler-chosen time with zero fill out of
//                 bounds and the swizzle applied to absolute shared addresses, full box bytes
//                 completed on the mbarrier; the destination written by someone else while the
//                 copy was in flight; a copy landing on bytes an unretired wgmma reads; copies
//                 pending at exit.
//  wgmma          all 128 threads of the warpgroup issue the same instruction with the same
//                 descriptors in the same commit group; wgmma.fence before the first wgmma after
//                 a wait_group (or at start); accumulator registers poisoned while in flight and
//                 written back only when wait_group retires their group (a thread writing one in
//                 between, an A register changing, or fence_regs on a register still in flight
//                 fail); operands read at a scheduler-chosen time between issue and retirement,
//                 through the real descriptor bits; reading bytes a TMA/cp.async copy in flight
//                 will still write; the operand bytes changing before every thread retired the
//                 instruction (slot released early); ops uncommitted or unretired at exit.
//  setmaxnreg     warpgroup-uniform, inc/dec direction, a per-CTA pool of threads x entry
//                 registers (an inc that the pool cannot satisfy waits; if nothing frees
//                 registers it is a deadlock).
//  cp.async       copies land between issue and the wait_group that covers them; pending at exit.
//  happens-before of shared memory (every run, whatever the schedule): each TMA box and cp.async
//                 copy is the recorded writer of its 16-byte granules; a read through ldmatrix,
//                 a wgmma operand (per issuing thread: its warp's A rows, all of B) or a UMMA
//                 operand (the issuing thread) must have acquired the write's completion (TMA:
//                 the mbarrier phase it completes, through try_wait; cp.async: the copying
//                 thread's wait_group, then a release of that thread). Once the launch uses the
//                 async proxy, ordinary stores are seen too (the window is write-protected while
//                 fibers run; a written page is diffed when the fiber switches out): the async
//                 proxy may read them only after a fence.proxy.async of the storing thread and a
//                 release of it after the fence; ldmatrix after a release after the store; a
//                 store into bytes a wgmma reads needs every reading thread's retirement acquired.
//                 ld.shared through sm80/shared.cuh: after a release of the storing thread after
//                 the store (or an async write's completion, as ldmatrix); a later store into the
//                 bytes needs a release of every loading thread after its load acquired.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// Fails the run: prints "EMU ERROR", the message, the CTA/thread and its call stack, then exits
// with status 3.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- the kernel's view of itself (threadIdx, blockIdx, ...) ----
const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();
unsigned dynamic_smem_bytes();

// ---- shared memory ----
// The shared window every kernel's `extern __shared__` array aliases (emu.h).
extern "C" unsigned char emu_shared_window[];
constexpr size_t kWindowBytes = 256 * 1024;
// Shared-window address of a generic pointer (fails when it does not point into the CTA's
// dynamic shared memory).
uint32_t cvta_shared(const void* p);
// Host pointer of [addr, addr + bytes) of the window (fails when out of the allocation).
unsigned char* smem_ptr(uint32_t addr, uint32_t bytes, const char* what);

// ---- CTA-wide and warp-wide synchronisation ----
void syncthreads();
// __syncthreads_or: the barrier, and whether any thread's predicate was nonzero.
int syncthreads_or(int predicate);
void bar_sync(unsigned id, unsigned count);
void bar_arrive(unsigned id, unsigned count);
void syncwarp(unsigned mask);
uint32_t shfl_xor(unsigned mask, uint32_t v, int lane_mask, int width);
uint32_t shfl_idx(unsigned mask, uint32_t v, int src_lane, int width);
bool elect_one();
[[noreturn]] void trap();

// ---- sm_80 ----
enum class Elem { F16, BF16, E4M3, E5M2 };
void cp_async(uint32_t dst, const void* src, int cp_size, int src_bytes);
void cp_async_commit();
void cp_async_wait(int n);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans);
// ld.shared.b32 and st.shared.v4.b32 (sm80/shared.cuh): a generic-proxy handoff between threads,
// its happens-before checked both ways (see "happens-before" above).
uint32_t ld_shared_b32(uint32_t addr);
void st_shared_v4(uint32_t addr, uint32_t x, uint32_t y, uint32_t z, uint32_t w);
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Elem e);
int ctaid(int dim);

// ---- approximate math (MUFU) ----
float ex2_approx_ftz(float x);
float tanh_approx(float x);

// ---- sm_90 mbarrier, TMA, fences ----
void mbar_init(uint32_t bar, uint32_t count);
void mbar_init_fence();
void mbar_arrive(uint32_t bar);
void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes);
bool mbar_try_wait_parity(uint32_t bar, uint32_t parity);
void fence_proxy_async();
void tma_prefetch(const void* map);
void tma_load(uint32_t dst, const void* map, uint32_t bar, const int32_t* coords, int rank);

// ---- sm_90 wgmma ----
struct WgmmaInstr {
    int m, n, k;       // shape: m64nNk16 (16-bit) / k32 (8-bit)
    Elem a_type, b_type;
    bool a_from_regs;  // RS form: A in 4 registers per thread
    uint64_t desc_a;   // SS form only
    uint64_t desc_b;
    int scale_d;       // 0: D = A B; 1: D = A B + D
    int scale_a, scale_b;  // +1 / -1
    int trans_a, trans_b;  // 1: MN-major operand
};
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int n);
void wgmma_issue(const WgmmaInstr& ins, float* d, const uint32_t* a_regs);
// Registers the kernel pins after a wait (fence_regs): they must not still be in flight.
void wgmma_check_regs(const float* d, int n);
void setmaxnreg(bool inc, int regs);

// ---- sm_100 tcgen05 (tensor memory, UMMA; implemented in tcgen05.cpp) ----
// Warp-collective allocation of `ncols` tensor-memory columns; the base address is written to the
// shared word at `dst`.
void tmem_alloc(uint32_t dst, uint32_t ncols);
void tmem_relinquish();
void tmem_dealloc(uint32_t taddr, uint32_t ncols);
// One thread issues D[d_tmem] (+)= A B^T (kind::f16, cta_group::1): A from a shared-memory
// descriptor (a_tmem false) or from tensor memory at address `a` (a_tmem true).
void umma_issue(uint32_t d_tmem, bool a_tmem, uint64_t a, uint64_t b_desc, uint32_t idesc, uint32_t accumulate);
// tcgen05.commit: one arrival on the mbarrier at `bar` once this thread's earlier MMAs completed.
void umma_commit(uint32_t bar);
// tcgen05.ld/st .32x32b.x<n>: registers r (valid after tmem_wait_ld / landed at tmem_wait_st).
void tmem_ld(uint32_t taddr, uint32_t* r, int n);
void tmem_wait_ld();
void tmem_st(uint32_t taddr, const uint32_t* r, int n);
void tmem_wait_st();
void tcgen05_fence(bool after);

// ---- TMA descriptors (the emulator's encoding of a CUtensorMap, 128 bytes) ----
// Same argument list and enum values as cuTensorMapEncodeTiled; returns 0 (CUDA_SUCCESS) or 1
// (CUDA_ERROR_INVALID_VALUE) with the reason in *why.
int encode_tensor_map_tiled(void* map, uint32_t data_type, uint32_t rank, const void* global_address,
                            const uint64_t* global_dim, const uint64_t* global_strides, const uint32_t* box_dim,
                            const uint32_t* element_strides, uint32_t interleave, uint32_t swizzle,
                            uint32_t l2_promotion, uint32_t oob_fill, std::string* why);
struct TensorMapFields {
    uint32_t data_type, rank, interleave, swizzle, l2_promotion, oob_fill;
    uint64_t global_address;
    uint64_t dims[5], strides[5];  // strides[0] = element size, strides[i] of dim i
    uint32_t box[5], elem_strides[5];
};
bool decode_tensor_map(const void* map, TensorMapFields* out);

// ---- launching ----
struct LaunchConfig {
    Dim3 grid, block;
    unsigned smem_bytes = 0;    // dynamic shared memory
    unsigned entry_regs = 0;    // registers per thread at entry (ptxas report); 0: 65536 / threads
    uint64_t seed = 1;          // scheduler seed
    uint32_t window_offset = 0; // shared address of the dynamic smem (0: chosen from the seed)
    bool verbose = false;
    // When asynchronous work (TMA boxes, cp.async copies, wgmma) lands: -1 (default) draws a
    // policy per copy (land at once, soon, as late as possible), so every run mixes all three;
    // 0, 1, 2 fix one for every copy (self-tests that need a particular timing).
    int land_policy = -1;
    std::string kernel;         // the kernel's name (fault reports)
};
// Describes a host address for a fault report (the driver's buffers: which one it is near).
void set_fault_describer(std::string (*describe)(uintptr_t host_addr));
// Runs `entry` (the kernel body, once per thread) over the grid, one CTA at a time. Returns
// normally when every CTA finished and every end-of-CTA check passed; fails the process
// otherwise.
void launch(const LaunchConfig& cfg, void (*entry)(void*), void* arg);

// Counters of the last launch (for the driver's summary line).
struct Stats {
    uint64_t ctas, switches, wgmma_ops, tma_copies, cp_async_copies, mbar_waits, deadlock_checks;
};
Stats stats();

// ---- kernels compiled into this program (emu.h's EMU_KERNEL registers them) ----
// Calls the kernel with its FwdParams and, for kernels that take them, its 128-byte tensor maps.
using KernelInvoker = void (*)(const void* params, const void* const* maps);
void register_kernel(const char* name, KernelInvoker invoke, int nmaps);
KernelInvoker find_kernel(const std::string& name, int* nmaps);
std::vector<std::string> kernel_names();

}  // namespace emu
