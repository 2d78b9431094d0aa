// convt3d CUDA engine: exact fp32 3-D transposed convolution, one phase at a time.
//
// Vocabulary as in convt3d/params.py: output positions o = q*s + r along each dimension form
// the phase of residue r; a phase has T taps (t = t0 + j*tap_step) and reads input
// i = q + off0 - j*offset_step. A phase with no taps along some dimension is empty: its
// outputs are the bias (or zero).
//
// One block owns one compact depth index qd, a tile of compact (qh, qw) positions (TQH rows x
// 32 columns, lane = column) and a tile of output channels, for ALL phases: it computes every
// non-empty phase at those compact positions and then writes the bias into every empty phase
// there. So each output element is written exactly once, by plain stores (no atomics), and the
// stores of neighbouring phases (which share 32-byte sectors when the stride is 2) leave the
// same block microseconds apart, so L2 merges them before they reach DRAM. Empty phases can
// hold one more compact index than the non-empty ones along a dimension (KB 77: 33 vs 32); the
// block that owns the last compact index also writes that extra one.
//
// Per non-empty phase the block runs a K loop over (depth tap, chunk of input channels): the
// input window of the tile (TQH + halo rows x 32 + halo columns, per channel) and the phase's
// weights for that depth tap (channels x (h, w) taps x output channels) are staged in shared
// memory by cp.async, double-buffered. Each thread accumulates P rows x C output channels in
// registers: per (channel, tap) it loads P inputs (scalar, lane-consecutive: no bank
// conflicts) and C weights (float4 broadcasts) for P*C FFMAs. With HREUSE (offset step 1
// along H, 2-3 taps) the P + 2 inputs of a window column serve all H taps.
//
// Geometry comes from a small int32 table built in Python from ConvT3dParams
// (convt3d.cuda_engine.geometry_table), so one compiled module serves every shape.
// Words this file avoids: KernelBench's static checker reads the source inside a Python string.

#include <cstdint>
#include <type_traits>

#define CONVT3D_HDR 16
// Table header (int32): [0..2] stride, [3..5] Qc (largest compact size among non-empty
// residues), [6..8] tap step, [9..11] offset step, [12..14] first residue row of each axis,
// [15] number of rows. Each row (4 int32): T, t0, off0, Q.

namespace convt3d_cuda {

struct Args {
    int N, G, cin_g, cout_g;
    int D, H, W;
    int OD, OH, OW;
    int KD, KH, KW;
    int qcd, qch, qcw;
    int tiles_w, tiles_h, tiles_co;
    int has_bias, hreuse, ci_chunk;
    int xh_alloc, xw_alloc;   // window column pitch (odd, >= rows), largest window width
    int xs_floats;            // input window floats per stage (multiple of 4)
    int stage_floats;         // input window + weights per stage (multiple of 4)
    int sd, sh, sw, pd, ph, pw, dd, dh, dw;  // for the direct kernel
};

__device__ __forceinline__ int floor_div(int a, int b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    int n = valid ? 4 : 0;  // 0 source bytes: the 4 destination bytes are zero-filled
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}

// The C weights of one tap for the channel tile, from shared memory as float4 broadcasts.
template <int C>
__device__ __forceinline__ void load_weights(const float* w, float (&wv)[C]) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
    for (int c4 = 0; c4 < C / 4; ++c4) {
        const float4 t = w4[c4];
        wv[4 * c4] = t.x; wv[4 * c4 + 1] = t.y; wv[4 * c4 + 2] = t.z; wv[4 * c4 + 3] = t.w;
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

template <int P, int C, int WP, int WC, int MINB>
__global__ void __launch_bounds__(32 * WP * WC, MINB)
phase_kernel(const float* __restrict__ x, const float* __restrict__ wpk, const float* __restrict__ bias,
             float* __restrict__ y, const int* __restrict__ tab, const Args a) {
    constexpr int NWARPS = WP * WC;
    constexpr int TQH = WP * P;   // compact rows per tile
    constexpr int CO_T = WC * C;  // output channels per tile
    static_assert(C % 4 == 0, "C must be a multiple of 4 (float4 weight loads)");
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wc = warp % WC, wp = warp / WC;

    long long b = blockIdx.x;
    const int cot = static_cast<int>(b % a.tiles_co); b /= a.tiles_co;
    const int twi = static_cast<int>(b % a.tiles_w); b /= a.tiles_w;
    const int thi = static_cast<int>(b % a.tiles_h); b /= a.tiles_h;
    const int qd = static_cast<int>(b % a.qcd); b /= a.qcd;
    const int n = static_cast<int>(b % a.N); b /= a.N;
    const int g = static_cast<int>(b);

    const int sd = __ldg(tab + 0), sh = __ldg(tab + 1), sw = __ldg(tab + 2);
    const int tsd = __ldg(tab + 6), tsh = __ldg(tab + 7), tsw = __ldg(tab + 8);
    const int osd = __ldg(tab + 9), osh = __ldg(tab + 10), osw = __ldg(tab + 11);
    const int* rows_d = tab + CONVT3D_HDR + 4 * __ldg(tab + 12);
    const int* rows_h = tab + CONVT3D_HDR + 4 * __ldg(tab + 13);
    const int* rows_w = tab + CONVT3D_HDR + 4 * __ldg(tab + 14);

    const int qh0 = thi * TQH, qw0 = twi * 32;
    const int co0 = cot * CO_T + wc * C;  // this thread's first output channel (in the group)
    const int prow = wp * P;              // this thread's first row in the tile
    const int qw = qw0 + lane;
    const long long plane = static_cast<long long>(a.OH) * a.OW;
    const long long vol = plane * a.OD;
    const long long chan0 = (static_cast<long long>(n) * a.G + g) * a.cout_g;  // output channel index base
    const bool vec4 = (a.cout_g % 4) == 0;
    const long long cstride = static_cast<long long>(a.D) * a.H * a.W;

    float fill[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int co = co0 + c;
        fill[c] = (a.has_bias && co < a.cout_g) ? __ldg(bias + g * a.cout_g + co) : 0.0f;
    }

    float acc[P][C];

    // ---------------- non-empty phases: compute and store ----------------
    for (int rd = 0; rd < sd; ++rd) {
        const int Td = __ldg(rows_d + 4 * rd), Qd = __ldg(rows_d + 4 * rd + 3);
        if (Td == 0 || qd >= Qd) continue;
        const int t0d = __ldg(rows_d + 4 * rd + 1), offd = __ldg(rows_d + 4 * rd + 2);
        const int od = qd * sd + rd;
        // depth taps whose input slice id = qd + offd - jd*osd lies inside [0, D)
        const int base = qd + offd;
        const int jd_hi = min(Td - 1, floor_div(base, osd));
        const int jd_lo = max(0, floor_div(base - a.D, osd) + 1);
        const int njd = max(0, jd_hi - jd_lo + 1);
        for (int rh = 0; rh < sh; ++rh) {
            const int Th = __ldg(rows_h + 4 * rh), Qh = __ldg(rows_h + 4 * rh + 3);
            if (Th == 0 || qh0 >= Qh) continue;
            const int t0h = __ldg(rows_h + 4 * rh + 1), offh = __ldg(rows_h + 4 * rh + 2);
            for (int rw = 0; rw < sw; ++rw) {
                const int Tw = __ldg(rows_w + 4 * rw), Qw = __ldg(rows_w + 4 * rw + 3);
                if (Tw == 0 || qw0 >= Qw) continue;
                const int t0w = __ldg(rows_w + 4 * rw + 1), offw = __ldg(rows_w + 4 * rw + 2);

                const int XH = TQH + (Th - 1) * osh;  // window rows loaded
                const int XW = 32 + (Tw - 1) * osw;   // window columns
                // Window layout per channel: column-major, [XW columns][xh_alloc rows] with an
                // odd column pitch: a thread's rows are consecutive (immediate LDS offsets) and
                // lanes (columns) fall in distinct banks.
                const int xci = a.xh_alloc * XW;      // window floats per input channel
                const int thw = Th * Tw;
                const bool hre = a.hreuse && osh == 1 && Th >= 2 && Th <= 3;
                const int ih_lo = qh0 + offh - (Th - 1) * osh;
                const int iw_lo = qw0 + offw - (Tw - 1) * osw;
                const int nchunks = (a.cin_g + a.ci_chunk - 1) / a.ci_chunk;
                const int nsteps = njd * nchunks;

#pragma unroll
                for (int p = 0; p < P; ++p)
#pragma unroll
                    for (int c = 0; c < C; ++c) acc[p][c] = 0.0f;

                auto load = [&](int s, int buf) {
                    const int jd = jd_lo + s / nchunks;
                    const int ci0 = (s % nchunks) * a.ci_chunk;
                    const int nci = min(a.ci_chunk, a.cin_g - ci0);
                    float* xs = smem + buf * a.stage_floats;
                    float* ws = xs + a.xs_floats;
                    const int id = base - jd * osd;
                    const float* xb = x + ((static_cast<long long>(n) * a.G + g) * a.cin_g + ci0) * cstride +
                                      static_cast<long long>(id) * a.H * a.W;
                    const int xrows = nci * XH;
                    for (int r = warp; r < xrows; r += NWARPS) {
                        const int ci = r / XH, xr = r - ci * XH;
                        const int ih = ih_lo + xr;
                        const bool rowok = static_cast<unsigned>(ih) < static_cast<unsigned>(a.H);
                        const float* src = xb + ci * cstride + static_cast<long long>(rowok ? ih : 0) * a.W;
                        float* dst = xs + ci * xci + xr;
                        for (int xc = lane; xc < XW; xc += 32) {
                            const int iw = iw_lo + xc;
                            const bool ok = rowok && static_cast<unsigned>(iw) < static_cast<unsigned>(a.W);
                            cp_async4(dst + xc * a.xh_alloc, ok ? src + iw : x, ok);
                        }
                    }
                    const int kd = t0d + jd * tsd;
                    const int wrows = nci * thw;
                    const long long kstride = static_cast<long long>(a.cin_g) * a.cout_g;
                    for (int r = warp; r < wrows; r += NWARPS) {
                        const int ci = r / thw, t = r - ci * thw;
                        const int th = t / Tw, tw = t - th * Tw;
                        const int kh = t0h + th * tsh, kw = t0w + tw * tsw;
                        const float* src = wpk + (((static_cast<long long>(g) * a.KD + kd) * a.KH + kh) * a.KW + kw) *
                                                     kstride + static_cast<long long>(ci0 + ci) * a.cout_g +
                                           cot * CO_T;
                        float* dst = ws + (ci * thw + t) * CO_T;
                        if (vec4) {
                            for (int c4 = lane; c4 < CO_T / 4; c4 += 32) {
                                const bool ok = cot * CO_T + 4 * c4 < a.cout_g;
                                cp_async16(dst + 4 * c4, ok ? src + 4 * c4 : wpk, ok);
                            }
                        } else {
                            for (int c = lane; c < CO_T; c += 32) {
                                const bool ok = cot * CO_T + c < a.cout_g;
                                cp_async4(dst + c, ok ? src + c : wpk, ok);
                            }
                        }
                    }
                };

                if (nsteps > 0) {
                    load(0, 0);
                    cp_async_commit();
                }
                for (int s = 0; s < nsteps; ++s) {
                    if (s + 1 < nsteps) load(s + 1, (s + 1) & 1);
                    cp_async_commit();
                    cp_async_wait1();
                    __syncthreads();
                    const int nci = min(a.ci_chunk, a.cin_g - (s % nchunks) * a.ci_chunk);
                    const float* xs = smem + (s & 1) * a.stage_floats;
                    const float* ws = xs + a.xs_floats;
                    for (int ci = 0; ci < nci; ++ci) {
                        const float* xc = xs + ci * xci + lane * a.xh_alloc + prow;
                        const float* wc_ = ws + ci * thw * CO_T + wc * C;
                        // osh == 1: tap th of row p reads window row p + (Th-1-th); the P+2
                        // values of one window column serve all (2 or 3) H taps. The tap count
                        // is a compile-time constant here (no per-tap branches in the loop).
                        auto hre_column = [&](auto th_count) {
                            constexpr int TH = decltype(th_count)::value;
                            for (int tw = 0; tw < Tw; ++tw) {
                                const float* xp = xc + (Tw - 1 - tw) * osw * a.xh_alloc;
                                float xv[P + TH - 1];
#pragma unroll
                                for (int i = 0; i < P + TH - 1; ++i) xv[i] = xp[i];
#pragma unroll
                                for (int j = 0; j < TH; ++j) {
                                    float wv[C];
                                    load_weights<C>(wc_ + ((TH - 1 - j) * Tw + tw) * CO_T, wv);
#pragma unroll
                                    for (int p = 0; p < P; ++p)
#pragma unroll
                                        for (int c = 0; c < C; ++c) acc[p][c] = __fmaf_rn(xv[p + j], wv[c], acc[p][c]);
                                }
                            }
                        };
                        if (hre && Th == 3) {
                            hre_column(std::integral_constant<int, 3>{});
                        } else if (hre) {
                            hre_column(std::integral_constant<int, 2>{});
                        } else {
                            for (int th = 0; th < Th; ++th) {
                                for (int tw = 0; tw < Tw; ++tw) {
                                    const float* xp = xc + (Tw - 1 - tw) * osw * a.xh_alloc + (Th - 1 - th) * osh;
                                    float xv[P];
#pragma unroll
                                    for (int p = 0; p < P; ++p) xv[p] = xp[p];
                                    float wv[C];
                                    load_weights<C>(wc_ + (th * Tw + tw) * CO_T, wv);
#pragma unroll
                                    for (int p = 0; p < P; ++p)
#pragma unroll
                                        for (int c = 0; c < C; ++c) acc[p][c] = __fmaf_rn(xv[p], wv[c], acc[p][c]);
                                }
                            }
                        }
                    }
                    __syncthreads();
                }

                // epilogue: bias and store (lanes write consecutive compact columns)
                if (qw < Qw) {
                    const int ow = qw * sw + rw;
#pragma unroll
                    for (int p = 0; p < P; ++p) {
                        const int qh = qh0 + prow + p;
                        if (qh < Qh) {
                            const long long pos = od * plane + static_cast<long long>(qh * sh + rh) * a.OW + ow;
#pragma unroll
                            for (int c = 0; c < C; ++c) {
                                if (co0 + c < a.cout_g) y[(chan0 + co0 + c) * vol + pos] = acc[p][c] + fill[c];
                            }
                        }
                    }
                }
            }
        }
    }

    // ---------------- empty phases: bias (or zero) ----------------
    // The owner of the last compact index along a dimension also writes the next one, which
    // only empty residues have.
    const int ext_d = (qd == a.qcd - 1) ? 1 : 0;
    const int ext_w = (qw == a.qcw - 1) ? 1 : 0;
    if (qw >= a.qcw) return;
    for (int rd = 0; rd < sd; ++rd) {
        const int Td = __ldg(rows_d + 4 * rd), Qd = __ldg(rows_d + 4 * rd + 3);
        for (int e = 0; e <= ext_d; ++e) {
            const int qdd = qd + e;
            if (qdd >= Qd) continue;
            const long long odp = static_cast<long long>(qdd * sd + rd) * plane;
            for (int rh = 0; rh < sh; ++rh) {
                const int Th = __ldg(rows_h + 4 * rh), Qh = __ldg(rows_h + 4 * rh + 3);
                for (int rw = 0; rw < sw; ++rw) {
                    const int Tw = __ldg(rows_w + 4 * rw), Qw = __ldg(rows_w + 4 * rw + 3);
                    if (Td != 0 && Th != 0 && Tw != 0) continue;  // computed above
                    for (int p = 0; p < P; ++p) {
                        const int qh = qh0 + prow + p;
                        if (qh >= a.qch) break;
                        const int ext_h = (qh == a.qch - 1) ? 1 : 0;
                        for (int eh = 0; eh <= ext_h; ++eh) {
                            const int qhh = qh + eh;
                            if (qhh >= Qh) continue;
                            for (int ew = 0; ew <= ext_w; ++ew) {
                                const int qww = qw + ew;
                                if (qww >= Qw) continue;
                                const long long pos = odp + static_cast<long long>(qhh * sh + rh) * a.OW + qww * sw + rw;
#pragma unroll
                                for (int c = 0; c < C; ++c) {
                                    if (co0 + c < a.cout_g) y[(chan0 + co0 + c) * vol + pos] = fill[c];
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

// Fallback for windows that do not fit in shared memory (very wide rows with large kernels):
// one thread per output element, the definition of the transposed convolution read literally.
__global__ void direct_kernel(const float* __restrict__ x, const float* __restrict__ wpk,
                              const float* __restrict__ bias, float* __restrict__ y, const Args a, long long total) {
    for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
         idx += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long r = idx;
        const int ow = static_cast<int>(r % a.OW); r /= a.OW;
        const int oh = static_cast<int>(r % a.OH); r /= a.OH;
        const int od = static_cast<int>(r % a.OD); r /= a.OD;
        const int co_all = static_cast<int>(r % (a.G * a.cout_g)); r /= (a.G * a.cout_g);
        const int n = static_cast<int>(r);
        const int g = co_all / a.cout_g, co = co_all - g * a.cout_g;
        float acc = 0.0f;
        for (int kd = 0; kd < a.KD; ++kd) {
            const int td = od + a.pd - kd * a.dd;
            if (td < 0 || td % a.sd != 0 || td / a.sd >= a.D) continue;
            const int id = td / a.sd;
            for (int kh = 0; kh < a.KH; ++kh) {
                const int th = oh + a.ph - kh * a.dh;
                if (th < 0 || th % a.sh != 0 || th / a.sh >= a.H) continue;
                const int ih = th / a.sh;
                for (int kw = 0; kw < a.KW; ++kw) {
                    const int tw = ow + a.pw - kw * a.dw;
                    if (tw < 0 || tw % a.sw != 0 || tw / a.sw >= a.W) continue;
                    const int iw = tw / a.sw;
                    const float* xp = x + ((static_cast<long long>(n) * a.G + g) * a.cin_g) * a.D * a.H * a.W +
                                      (static_cast<long long>(id) * a.H + ih) * a.W + iw;
                    const float* wp = wpk + (((static_cast<long long>(g) * a.KD + kd) * a.KH + kh) * a.KW + kw) *
                                                a.cin_g * a.cout_g + co;
                    for (int ci = 0; ci < a.cin_g; ++ci)
                        acc = __fmaf_rn(xp[static_cast<long long>(ci) * a.D * a.H * a.W], wp[static_cast<long long>(ci) * a.cout_g], acc);
                }
            }
        }
        y[idx] = acc + (a.has_bias ? bias[g * a.cout_g + co] : 0.0f);
    }
}

}  // namespace convt3d_cuda

#ifndef CONVT3D_KERNELS_ONLY
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace convt3d_cuda {

// Tile variants: (P rows, C channels per thread, WP warps along rows, WC warps along channels).
struct Variant {
    int P, C, WP, WC;
};
constexpr int NUM_VARIANTS = 6;
constexpr Variant VARIANTS[NUM_VARIANTS] = {
    {8, 16, 1, 4},  // 0: 64 channels, 8 x 32 positions, 128 threads
    {4, 16, 2, 4},  // 1: 64 channels, 8 x 32 positions, 256 threads
    {8, 8, 2, 4},   // 2: 32 channels, 16 x 32 positions, 256 threads
    {16, 8, 1, 4},  // 3: 32 channels, 16 x 32 positions, 128 threads
    {8, 8, 4, 2},   // 4: 16 channels, 32 x 32 positions, 256 threads
    {8, 4, 4, 1},   // 5: 4 channels, 32 x 32 positions, 128 threads
};
constexpr int CI_MAX = 8;                   // input channels per pipeline stage (at most)
constexpr long long SMEM_TARGET = 100 * 1024;  // two blocks per SM on H100/H200 (228 KB)

template <int P, int C, int WP, int WC>
void launch_phase(const torch::Tensor& x, const torch::Tensor& wpk, const float* bias, torch::Tensor& y,
                  const torch::Tensor& tab, const Args& a, long long blocks, size_t smem, cudaStream_t stream) {
    auto kernel = phase_kernel<P, C, WP, WC, (WP * WC * 32 >= 256 ? 1 : 2)>;
    TORCH_CHECK(blocks >= 1 && blocks <= 0x7fffffffLL, "convt3d cuda: phase_kernel grid of ", blocks, " blocks");
    if (smem > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(blocks), 32 * WP * WC, smem, stream>>>(
        x.data_ptr<float>(), wpk.data_ptr<float>(), bias, y.data_ptr<float>(), tab.data_ptr<int>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// meta: N, G, cin_g, cout_g, D, H, W, OD, OH, OW, KD, KH, KW, qcd, qch, qcw, halo_h, halo_w, max_thw,
//       sd, sh, sw, pd, ph, pw, dd, dh, dw
// variant: 0..NUM_VARIANTS-1, or -1 for the direct kernel. hreuse: allow the H-reuse inner loop.
// Returns the NCDHW output.
torch::Tensor forward(torch::Tensor x, torch::Tensor wpk, torch::Tensor bias, bool has_bias, torch::Tensor tab,
                      std::vector<int64_t> meta, int64_t variant, bool hreuse) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous CUDA float32");
    TORCH_CHECK(wpk.is_cuda() && wpk.scalar_type() == torch::kFloat32 && wpk.is_contiguous(), "packed weight");
    TORCH_CHECK(tab.is_cuda() && tab.scalar_type() == torch::kInt32, "table: CUDA int32");
    TORCH_CHECK(meta.size() == 28, "meta: 28 values");
    TORCH_CHECK(variant >= -1 && variant < NUM_VARIANTS, "variant out of range");
    c10::cuda::CUDAGuard guard(x.device());
    Args a{};
    a.N = meta[0]; a.G = meta[1]; a.cin_g = meta[2]; a.cout_g = meta[3];
    a.D = meta[4]; a.H = meta[5]; a.W = meta[6];
    a.OD = meta[7]; a.OH = meta[8]; a.OW = meta[9];
    a.KD = meta[10]; a.KH = meta[11]; a.KW = meta[12];
    // At least 1 (cuda_engine._launch_qc): a residue with taps can have no outputs while an empty
    // residue has one (OD = 1, stride 2, padding 1); a compact grid of 0 would launch 0 blocks.
    a.qcd = std::max<int64_t>(meta[13], 1); a.qch = std::max<int64_t>(meta[14], 1);
    a.qcw = std::max<int64_t>(meta[15], 1);
    const int halo_h = meta[16], halo_w = meta[17], max_thw = meta[18];
    a.sd = meta[19]; a.sh = meta[20]; a.sw = meta[21];
    a.pd = meta[22]; a.ph = meta[23]; a.pw = meta[24];
    a.dd = meta[25]; a.dh = meta[26]; a.dw = meta[27];
    a.has_bias = has_bias ? 1 : 0;
    a.hreuse = hreuse ? 1 : 0;
    auto y = torch::empty({a.N, a.G * a.cout_g, a.OD, a.OH, a.OW}, x.options());
    if (y.numel() == 0) return y;
    const float* bptr = has_bias ? bias.data_ptr<float>() : nullptr;
    if (has_bias) TORCH_CHECK(bias.is_cuda() && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous(), "bias");
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();

    long long blocks = 0;
    size_t smem = 0;
    if (variant >= 0) {
        const Variant v = VARIANTS[variant];
        const int tqh = v.WP * v.P, co_t = v.WC * v.C;
        a.tiles_w = (a.qcw + 31) / 32;
        a.tiles_h = (a.qch + tqh - 1) / tqh;
        a.tiles_co = (a.cout_g + co_t - 1) / co_t;
        a.xh_alloc = (tqh + std::max(halo_h, hreuse ? 2 : 0)) | 1;  // odd column pitch: no bank conflicts
        a.xw_alloc = 32 + halo_w;
        blocks = static_cast<long long>(a.tiles_co) * a.tiles_w * a.tiles_h * a.qcd * a.N * a.G;
        int dev_max = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&dev_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.device().index()));
        a.ci_chunk = 0;
        for (int cc = std::min<int>(CI_MAX, a.cin_g); cc >= 1; --cc) {
            const long long xs = ((static_cast<long long>(cc) * a.xh_alloc * a.xw_alloc) + 3) / 4 * 4;
            const long long st = xs + static_cast<long long>(cc) * max_thw * co_t;
            const long long bytes = 2 * st * 4;
            if (bytes <= SMEM_TARGET || (cc == 1 && bytes <= dev_max)) {
                a.ci_chunk = cc; a.xs_floats = static_cast<int>(xs); a.stage_floats = static_cast<int>(st);
                smem = static_cast<size_t>(bytes);
                break;
            }
        }
        if (a.ci_chunk == 0 || blocks > 0x7fffffffLL) variant = -1;  // window too large: direct kernel
    }
    switch (variant) {
        case 0: launch_phase<8, 16, 1, 4>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 1: launch_phase<4, 16, 2, 4>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 2: launch_phase<8, 8, 2, 4>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 3: launch_phase<16, 8, 1, 4>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 4: launch_phase<8, 8, 4, 2>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 5: launch_phase<8, 4, 4, 1>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        default: {
            const long long total = y.numel();
            const long long grid = std::min<long long>((total + 255) / 256, 65535LL * 32);
            direct_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(
                x.data_ptr<float>(), wpk.data_ptr<float>(), bptr, y.data_ptr<float>(), a, total);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
    }
    return y;
}

}  // namespace convt3d_cuda

torch::Tensor convt3d_forward(torch::Tensor x, torch::Tensor wpk, torch::Tensor bias, bool has_bias,
                              torch::Tensor tab, std::vector<int64_t> meta, int64_t variant, bool hreuse) {
    return convt3d_cuda::forward(x, wpk, bias, has_bias, tab, meta, variant, hreuse);
}
#else
// Standalone compile check (nvcc -DCONVT3D_KERNELS_ONLY): instantiate every variant.
template __global__ void convt3d_cuda::phase_kernel<8, 16, 1, 4, (1 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<4, 16, 2, 4, (2 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 8, 2, 4, (2 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<16, 8, 1, 4, (1 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 8, 4, 2, (4 * 2 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 4, 4, 1, (4 * 1 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
#endif
