// convt3d CUDA engine: fp32 3-D transposed convolution (exact, or TF32 mode), one phase at a time.
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
// gemm_kernel (below phase_kernel; its comment has the details) is the register-blocked
// alternative: per phase an implicit GEMM with a 256-position x 64-channel block tile, 8 x 8 per
// thread, the input gathered per tap into a k-major shared-memory tile by cp.async, 2-3 stages,
// and an epilogue that writes whole output rows (computed and bias elements interleaved).
// Its HALO form (variant g64r) stages the tile's input window once per (depth tap, chunk of input
// channels) with the weights of all (h, w) taps and reuses it across them from shared memory.
// Its MMA form (variants g64t, g64t16; TF32 mode only) multiplies the same staged tiles on the
// tensor cores, mma.sync m16n8k8 TF32 with fp32 accumulation: 8 warps of 64 positions x 32
// channels each, the stage tiles' rows padded by 8 floats so every fragment load is free of
// bank conflicts. The operands are TF32 values already (rounded by round_tf32_kernel), so the tensor
// cores multiply them exactly as the FFMA kernels do; only the summation order differs.
//
// TF32 mode (tf32 = true in convt3d_forward): the input and the packed weight are first rounded
// to TF32 by round_tf32_kernel (cvt.rna: round to nearest, ties away from zero, the rounding
// cuDNN applies before its TF32 tensor-core products), then the same FFMA kernels run. A product
// of two TF32 values (11-bit significands) has at most 22 significant bits, so each FFMA product
// is exact in fp32 and only the fp32 accumulation rounds: the TF32 numerics of PyTorch's
// default-flag convolutions. Exact mode (tf32 = false) multiplies the fp32 operands as they are.
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
    int tiles_hw;             // gemm_kernel: tiles of the flattened compact (qh, qw) plane
    // gemm_kernel HALO (floats): halo row pitch, halo per input channel, halo per stage, halo +
    // weights per stage, pipeline/epilogue region (the tap table follows it)
    int halo_pitch, halo_ch, halo_a, halo_stage, region;
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

// fp32 -> the nearest TF32 value, ties away from zero (inf and NaN stay inf and NaN): what
// convt3d's Triton engine computes with its bit trick ((bits + 0x1000) & ~0x1fff).
__device__ __forceinline__ float to_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return __uint_as_float(r);
}

// dst[i] = to_tf32(src[i]) for i < n (grid-stride; both contiguous).
__global__ void round_tf32_kernel(const float* __restrict__ src, float* __restrict__ dst, long long n) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
        dst[i] = to_tf32(src[i]);
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


// ================================ gemm_kernel ================================
// Register-blocked implicit GEMM, one non-empty phase at a time (the FFMA SGEMM recipe).
// Template: BN output channels per block (64 or 32), BK input channels per K step, STAGES.
//
// Block: 256 threads, a tile of BM compact positions x BN output channels (BM = 256 for BN = 64,
// 512 for BN = 32), each thread an 8 x 8 register tile: positions {4tm..4tm+3, BM/2+4tm..+3}
// x channels {4tn..4tn+3, BN/2+4tn..+3}. Per k it reads two float4 of A and two of B from
// shared memory and issues 64 FFMAs. Within a warp, lane = tn * (32/TN) + (tm mod 32/TN).
//
// Positions: the block owns one compact depth index qd and the compact (qh, qw) positions
// p in [p0, p1) of the flattened compact plane p = qh * qcw + qw (p0 = tile * BM), so a tile has
// no waste at the end of each row when qcw is not a multiple of 32.
//
// K loop: steps over (depth tap jd, height tap jh, width tap jw, chunk of BK input channels).
// Per step the A tile [BK][BM] (k-major: the loader's lanes write consecutive positions, the
// compute reads float4 along M) is gathered by 4-byte cp.async, zero-filled outside the input:
// for position (qd, qh, qw) and tap (jd, jh, jw) the input is (qd + offd - jd*osd,
// qh + offh - jh*osh, qw + offw - jw*osw), affine in the position, so a warp reads a contiguous
// input row segment; the tail chunk of a channel count that is not a multiple of BK zero-fills
// the missing channels. The B tile [BK][BN] is the weight rows of that tap, packed with input and
// output channels zero-padded to multiples of BK and BN (cuda_engine.pack_weight_padded): one
// 16-byte cp.async per float4, no masks. STAGES (2-3) steps in flight, one barrier per step. The tap
// offsets of the phase (input offset, kernel tap) sit in a small table in shared memory, so the
// loader keeps only a tap and a chunk counter across steps (register budget: 128 per thread for
// two blocks of 256 threads per SM).
//
// Output ownership (each element written exactly once, plain stores): compact index q along a
// dimension owns the outputs I(q) = [q*s, (q+1)*s), the last one (q = qc - 1) up to the end of the
// dimension, and these intervals partition [0, O). The block owns I(qd) x I(qh) x I(qw) for its
// positions: per compact row qh the W run [qw_a*sw, qw_b*sw) (to OW if qw_b = qcw) of output
// rows I(qh) in planes I(qd). In that box an element of a phase with taps is this block's
// accumulator at compact index ((od-rd)/sd, (oh-rh)/sh, (ow-rw)/sw) (the extension past the
// last compact index only holds residues without taps), and every other element is the bias.
//   * Rows whose depth or height residue has no taps are bias only: written first, as
//     contiguous runs (merged across rows and planes when the block covers whole rows),
//     scalar head, float4 body, scalar tail.
//   * Rows whose depth and height residues have taps are written by the epilogue of the phase
//     (rd, rh, rw): the tile goes through shared memory (half of the channels at a time), and a
//     warp writes one output row run per (channel, compact row) with consecutive lanes on
//     consecutive addresses: the elements of width residue rw from the tile, and, in the
//     round of the first width residue with taps, the elements of the width residues without
//     taps (bias). KB 77: the odd rows of the odd planes come out as whole contiguous rows,
//     computed and bias interleaved.
constexpr int GEMM_THREADS = 256;
constexpr int GEMM_MAX_TAPS = 4096;  // kD*kH*kW of the tap table in shared memory (64 KB)
// HALO tiles: a thread's group of 4 positions reads 8 window columns (two float4), so width taps
// may shift its window by 0-4 columns ((Tw-1)*osw <= 4; KB 77: 2, KB 68: 4).
constexpr int HALO_MAX_SHIFT = 4;

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// d += a * b on the tensor cores: a 16 x 8 (rows m, columns k) by 8 x 8 (k, n) TF32 product per
// warp, fp32 accumulators. Fragments (PTX's m16n8k8 layout; g = lane / 4, t = lane % 4):
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma_tf32(float* d, const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 32 lanes of a warp write v to p[0, len): scalar head up to a 16-byte boundary, float4 body,
// scalar tail.
__device__ __forceinline__ void fill_span(float* p, long long len, float v, int lane) {
    long long head = static_cast<long long>((4 - ((reinterpret_cast<uintptr_t>(p) >> 2) & 3)) & 3);
    if (head > len) head = len;
    if (lane < head) p[lane] = v;
    const long long n4 = (len - head) >> 2;
    float4* q = reinterpret_cast<float4*>(p + head);
    const float4 v4 = make_float4(v, v, v, v);
    for (long long i = lane; i < n4; i += 32) q[i] = v4;
    const long long tail = (len - head) & 3;
    if (lane < tail) p[head + 4 * n4 + lane] = v;
}

template <int BN, int BK, int STAGES, int MINB, bool HALO = false, bool MMA = false>
__global__ void __launch_bounds__(256, MINB)
gemm_kernel(const float* __restrict__ x, const float* __restrict__ wpk, const float* __restrict__ bias,
            float* __restrict__ y, const int* __restrict__ tab, const Args a) {
    constexpr int NT = 256, NWARPS = NT / 32;
    constexpr int TN = BN / 8;         // threads along N, 8 channels each
    constexpr int TM = NT / TN;        // threads along M, 8 positions each
    constexpr int BM = 8 * TM;         // positions per tile
    constexpr int MPT = BM / NT;       // positions each thread stages in the loader
    constexpr int LM = 32 / TN;        // lanes along M within a warp
    constexpr int HBN = BN / 2;
    // MMA: stage rows padded by 8 floats (pitch = 8 mod 32 banks), so a fragment load (rows t,
    // columns g) touches 32 distinct banks
    constexpr int PAD = MMA ? 8 : 0;
    constexpr int AP = BM + PAD, BP = BN + PAD;  // row pitch of the A [BK][BM] and B [BK][BN] tiles
    constexpr int A_ST = BK * AP, B_ST = BK * BP;
    constexpr int B_VEC = BK * BN / 4;       // float4 of B per step
    constexpr int B_ROWS = NT / (BN / 4);    // rows of B one sweep of the threads covers
    // Epilogue tile [HBN][CPITCH]: CPITCH/4 odd, so the 8 lanes of a quarter warp (4 tm x 2 tn,
    // or 8 tm) store their float4 to 8 distinct 16-byte bank groups.
    constexpr int CPITCH = BM + 4;
    static_assert(TN * TM == NT && (32 % TN) == 0 && BM % NT == 0 && (CPITCH / 4) % 2 == 1, "tile shape");
    static_assert(NT % (BN / 4) == 0 && STAGES >= 2, "B rows per sweep, pipeline depth");
    // MMA: 4 x 2 warps of 64 positions x 32 channels tile the 256 x 64 block
    static_assert(!MMA || (!HALO && BN == 64 && BM == 256 && BK % 8 == 0), "tensor-core tile");
    // the pipeline buffers and the epilogue tile share one region (the larger of the two)
    constexpr int REGION = STAGES * (A_ST + B_ST) > HBN * CPITCH ? STAGES * (A_ST + B_ST) : HBN * CPITCH;
    extern __shared__ float4 smem4[];
    float* const As = reinterpret_cast<float*>(smem4);  // [STAGES][BK][BM]
    float* const Bs = As + STAGES * A_ST;               // [STAGES][BK][BN]
    float* const Cs = As;                               // [HBN][CPITCH], after the K loop
    // [taps of the phase]; HALO: after the runtime-sized region (the launcher's a.region)
    int4* const taps = reinterpret_cast<int4*>(As + (HALO ? a.region : REGION));

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tn = lane / LM;
    const int tm = warp * LM + lane % LM;
    // MMA: the warp's 64 x 32 sub-tile (positions wm*64.., channels wn*32..), fragment coordinates
    const int wm = warp & 3, wn = warp >> 2, fg = lane >> 2, ft = lane & 3;

    long long b = blockIdx.x;
    const int cot = static_cast<int>(b % a.tiles_co); b /= a.tiles_co;
    const int thw = static_cast<int>(b % a.tiles_hw); b /= a.tiles_hw;
    const int qd = static_cast<int>(b % a.qcd); b /= a.qcd;
    const int n = static_cast<int>(b % a.N); b /= a.N;
    const int g = static_cast<int>(b);

    const int sd = __ldg(tab + 0), sh = __ldg(tab + 1), sw = __ldg(tab + 2);
    const int* rows_d = tab + CONVT3D_HDR + 4 * __ldg(tab + 12);
    const int* rows_h = tab + CONVT3D_HDR + 4 * __ldg(tab + 13);
    const int* rows_w = tab + CONVT3D_HDR + 4 * __ldg(tab + 14);

    const int qcw = a.qcw, qch = a.qch;
    const int p0 = thw * BM;                          // first flattened compact (qh, qw) of the tile
    const int p1 = min(p0 + BM, qch * qcw);           // one past the last
    const int qh_a = p0 / qcw, qh_b = (p1 - 1) / qcw; // first and last compact rows touched
    const int co_base = cot * BN;                     // first output channel (in the group)
    const long long chan0 = (static_cast<long long>(n) * a.G + g) * a.cout_g;

    // ---------------- rows no tap reaches: bias (or zero) ----------------
    {
        const long long plane = static_cast<long long>(a.OH) * a.OW, vol = plane * a.OD;
        const int od_lo = qd * sd;
        const int od_hi = (qd == a.qcd - 1) ? a.OD : min(a.OD, od_lo + sd);
        long long run0 = 0, runlen = 0;  // the pending contiguous run (offset in a channel's volume)
        auto flush = [&]() {
            if (runlen == 0) return;
            for (int cl = warp; cl < BN; cl += NWARPS) {
                const int co = co_base + cl;
                if (co >= a.cout_g) break;
                const float v = a.has_bias ? __ldg(bias + g * a.cout_g + co) : 0.0f;
                fill_span(y + (chan0 + co) * vol + run0, runlen, v, lane);
            }
            runlen = 0;
        };
        for (int od = od_lo; od < od_hi; ++od) {
            const int rd = od - od_lo;  // >= sd: past the last compact index (no taps there)
            const bool live_d = rd < sd && __ldg(rows_d + 4 * rd) != 0;
            for (int qh = qh_a; qh <= qh_b; ++qh) {
                const int qw_a = (qh == qh_a) ? p0 - qh * qcw : 0;
                const int qw_b = (qh == qh_b) ? p1 - qh * qcw : qcw;
                const int ow_a = qw_a * sw;
                const int ow_b = (qw_b == qcw) ? a.OW : min(a.OW, qw_b * sw);
                const int oh_lo = qh * sh;
                const int oh_hi = (qh == qch - 1) ? a.OH : min(a.OH, oh_lo + sh);
                for (int oh = oh_lo; oh < oh_hi; ++oh) {
                    const int rh = oh - oh_lo;
                    const bool live_h = rh < sh && __ldg(rows_h + 4 * rh) != 0;
                    if (live_d && live_h) continue;  // the epilogue of phase (rd, rh, *) writes it
                    const long long start = od * plane + static_cast<long long>(oh) * a.OW + ow_a;
                    const int len = ow_b - ow_a;
                    if (runlen > 0 && run0 + runlen == start) {
                        runlen += len;
                    } else {
                        flush();
                        run0 = start;
                        runlen = len;
                    }
                }
            }
        }
        flush();
    }

    // ---------------- non-empty phases ----------------
    // The positions this thread stages: m = tid + NT*u, flattened p = p0 + m, compact (pqh, pqw).
    int pqh[MPT], pqw[MPT];
    bool pin[MPT];
#pragma unroll
    for (int u = 0; u < MPT; ++u) {
        const int p = p0 + tid + NT * u;
        pin[u] = p < p1;
        pqh[u] = pin[u] ? p / qcw : 0;
        pqw[u] = pin[u] ? p - pqh[u] * qcw : 0;
    }
    // Packed weights (cuda_engine.pack_weight_padded): [G][KD][KH][KW][cin_pad][cout_pad], zero
    // past cin_g and cout_g, so B needs no masks. This thread's float4 of B: rows kb + i*B_ROWS,
    // column 4*cb.
    const int nchunks = (a.cin_g + BK - 1) / BK;
    const int cout_pad = a.tiles_co * BN;
    const long long wtap = static_cast<long long>(nchunks) * BK * cout_pad;  // floats per tap
    const int kb = tid / (BN / 4), cb = tid - kb * (BN / 4);
    const float* const wthr = wpk + co_base + kb * cout_pad + 4 * cb;
    // input channel stride; a group's input cin_g * D*H*W < 2^31 (the launcher checks), so the
    // loader's channel offsets are int
    const int cstride = a.D * a.H * a.W;
    const float* const xg = x + (static_cast<long long>(n) * a.G + g) * a.cin_g * static_cast<long long>(cstride);
    float acc[8][8];

    for (int rd = 0; rd < sd; ++rd) {
        const int Td = __ldg(rows_d + 4 * rd), Qd = __ldg(rows_d + 4 * rd + 3);
        if (Td == 0 || qd >= Qd) continue;
        // depth taps whose input slice id = qd + offd - jd*osd lies inside [0, D)
        const int dbase = qd + __ldg(rows_d + 4 * rd + 2);
        const int osd = __ldg(tab + 9);
        const int jd_hi = min(Td - 1, floor_div(dbase, osd));
        const int jd_lo = max(0, floor_div(dbase - a.D, osd) + 1);
        const int njd = max(0, jd_hi - jd_lo + 1);
        for (int rh = 0; rh < sh; ++rh) {
            const int Th = __ldg(rows_h + 4 * rh), Qh = __ldg(rows_h + 4 * rh + 3);
            if (Th == 0 || qh_a >= Qh) continue;  // no row of this residue in the tile
            for (int rw = 0; rw < sw; ++rw) {
                const int Tw = __ldg(rows_w + 4 * rw);
                if (Tw == 0) continue;
                // Not skipped when the tile holds no column of this residue: its epilogue may still
                // owe the bias of the width residues without taps (it then only computes zeros).
                const int ntaps = njd * Th * Tw;
                // HALO: one step per (depth tap, channel chunk), all (h, w) taps of the phase in it
                const int nsteps = (HALO ? njd : ntaps) * nchunks;

                // Tap table of the phase, entry t = ((jd - jd_lo) * Th + jh) * Tw + jw:
                // (input row offset dh, column offset dw, input offset id*H*W + dh*W + dw, kernel tap).
                // The previous phase's last barrier (epilogue) guards the overwrite.
                for (int t = tid; t < ntaps; t += NT) {
                    const int jw = t % Tw, jh = (t / Tw) % Th, jd = jd_lo + t / (Tw * Th);
                    const int id = dbase - jd * osd;
                    const int dh = __ldg(rows_h + 4 * rh + 2) - jh * __ldg(tab + 10);
                    const int dw = __ldg(rows_w + 4 * rw + 2) - jw * __ldg(tab + 11);
                    const int kd = __ldg(rows_d + 4 * rd + 1) + jd * __ldg(tab + 6);
                    const int kh = __ldg(rows_h + 4 * rh + 1) + jh * __ldg(tab + 7);
                    const int kw = __ldg(rows_w + 4 * rw + 1) + jw * __ldg(tab + 8);
                    taps[t] = make_int4(dh, dw, (id * a.H + dh) * a.W + dw, ((g * a.KD + kd) * a.KH + kh) * a.KW + kw);
                }
                __syncthreads();

#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

                if constexpr (!HALO) {
                    // Loader state: the next step to stage is (tap l_tap, channel chunk l_chunk).
                    int l_chunk = 0, l_tap = 0;
                    const float* asrc[MPT];  // channel 0 of the position's input for the tap (or xg)
                    bool aok[MPT];
                    const float* bsrc = wthr;
                    auto set_tap = [&]() {
                        const int4 e = taps[l_tap];
#pragma unroll
                        for (int u = 0; u < MPT; ++u) {
                            const int ih = pqh[u] + e.x, iw = pqw[u] + e.y;
                            aok[u] = pin[u] && static_cast<unsigned>(ih) < static_cast<unsigned>(a.H) &&
                                     static_cast<unsigned>(iw) < static_cast<unsigned>(a.W);
                            // masked positions keep a valid address (cp.async reads nothing for them)
                            asrc[u] = xg + (aok[u] ? pqh[u] * a.W + pqw[u] + e.z : 0);
                        }
                        bsrc = wthr + e.w * wtap;
                    };
                    auto load_step = [&](int buf) {
                        const int ci0 = l_chunk * BK;
                        float* as = As + buf * A_ST + tid;
                        if (ci0 + BK <= a.cin_g) {
#pragma unroll
                            for (int u = 0; u < MPT; ++u) {
                                const float* src = asrc[u] + ci0 * cstride;  // int: cin_g*D*H*W < 2^31
#pragma unroll
                                for (int k = 0; k < BK; ++k) {
                                    cp_async4(as + k * AP + NT * u, src, aok[u]);
                                    src += cstride;
                                }
                            }
                        } else {  // the last chunk of a channel count that is not a multiple of BK
#pragma unroll
                            for (int u = 0; u < MPT; ++u) {
#pragma unroll 1
                                for (int k = 0; k < BK; ++k) {
                                    const bool ok = aok[u] && ci0 + k < a.cin_g;
                                    cp_async4(as + k * AP + NT * u, ok ? asrc[u] + (ci0 + k) * cstride : xg, ok);
                                }
                            }
                        }
#pragma unroll
                        for (int i = 0; i < (B_VEC + NT - 1) / NT; ++i) {
                            if (B_VEC % NT == 0 || tid + NT * i < B_VEC)
                                cp_async16(Bs + buf * B_ST + (kb + i * B_ROWS) * BP + 4 * cb,
                                           bsrc + static_cast<long long>(ci0 + i * B_ROWS) * cout_pad, true);
                        }
                        if (++l_chunk == nchunks) {
                            l_chunk = 0;
                            if (++l_tap < ntaps) set_tap();
                        }
                    };

                    if (nsteps > 0) set_tap();
#pragma unroll
                    for (int s = 0; s < STAGES - 1; ++s) {
                        if (s < nsteps) load_step(s);
                        cp_async_commit();
                    }
                    int cbuf = 0, lbuf = STAGES - 1;
                    for (int s = 0; s < nsteps; ++s) {
                        cp_async_wait<STAGES - 2>();  // this thread's copies of step s have landed
                        __syncthreads();              // everyone's have; everyone is done with step s - 1
                        if (s + STAGES - 1 < nsteps) load_step(lbuf);  // into the buffer of step s - 1
                        cp_async_commit();
                        lbuf = (lbuf + 1 == STAGES) ? 0 : lbuf + 1;
                        if constexpr (MMA) {
                            // per 8 channels: 4 x 4 mma of the warp's 64 x 32 sub-tile; the
                            // accumulator of (m16 tile i, n8 tile j) is acc[2i + j/2][4(j%2) ..]
                            const float* ak = As + cbuf * A_ST + ft * AP + wm * 64 + fg;
                            const float* bk = Bs + cbuf * B_ST + ft * BP + wn * 32 + fg;
#pragma unroll
                            for (int k0 = 0; k0 < BK; k0 += 8) {
                                unsigned af[4][4], bf[4][2];
#pragma unroll
                                for (int i = 0; i < 4; ++i) {
                                    const float* q = ak + k0 * AP + 16 * i;
                                    af[i][0] = __float_as_uint(q[0]);
                                    af[i][1] = __float_as_uint(q[8]);
                                    af[i][2] = __float_as_uint(q[4 * AP]);
                                    af[i][3] = __float_as_uint(q[4 * AP + 8]);
                                }
#pragma unroll
                                for (int j = 0; j < 4; ++j) {
                                    const float* q = bk + k0 * BP + 8 * j;
                                    bf[j][0] = __float_as_uint(q[0]);
                                    bf[j][1] = __float_as_uint(q[4 * BP]);
                                }
#pragma unroll
                                for (int i = 0; i < 4; ++i)
#pragma unroll
                                    for (int j = 0; j < 4; ++j) mma_tf32(&acc[2 * i + j / 2][4 * (j % 2)], af[i], bf[j]);
                            }
                        } else {
                            const float* ak = As + cbuf * A_ST + 4 * tm;
                            const float* bk = Bs + cbuf * B_ST + 4 * tn;
#pragma unroll
                            for (int k = 0; k < BK; ++k) {
                                const float4 a0 = lds4(ak + k * BM), a1 = lds4(ak + k * BM + BM / 2);
                                const float4 b0 = lds4(bk + k * BN), b1 = lds4(bk + k * BN + HBN);
                                const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                                const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                                for (int i = 0; i < 8; ++i)
#pragma unroll
                                    for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(av[i], bv[j], acc[i][j]);
                            }
                        }
                        cbuf = (cbuf + 1 == STAGES) ? 0 : cbuf + 1;
                    }
                } else {
                    // ---- HALO: the tile's input window, staged once per (depth tap, chunk) ----
                    // Step (jdi, chunk): window [BK][nr][halo_pitch] of input rows ih_lo + r, columns
                    // iw_lo + c (zero outside the input and past cin_g), and the weights of all
                    // Th*Tw (h, w) taps of depth tap jd_lo + jdi, [Th*Tw][BK][BN]. A position
                    // (qh, qw) reads tap (jh, jw) at window row qh - qh_a + (Th-1-jh)*osh, column
                    // qw + (Tw-1-jw)*osw. The launcher runs this only for qcw % 4 == 0 and width
                    // shifts (Tw-1)*osw <= HALO_MAX_SHIFT (else the plain tile of the same BN/BK), so
                    // each group of 4 positions of a thread lies in one compact row, 16-byte
                    // aligned in the window (halo_pitch = qcw + 4), and two float4 (8 columns)
                    // hold its inputs for every width tap: KB 77 (3 x 3 taps of shift 0-2 per
                    // depth tap) reads 4 float4 of A per (channel, jh) for 3 x 64 FFMAs, instead
                    // of 2 per 64, and gathers 10 x 36 input floats per channel from L2 instead
                    // of 9 x 256.
                    const int hosh = __ldg(tab + 10), hosw = __ldg(tab + 11);
                    const int thw_n = Th * Tw;
                    const int hp = a.halo_pitch, hch = a.halo_ch;
                    const int nr = (qh_b - qh_a + 1) + (Th - 1) * hosh;  // window rows (launcher: <= hch / hp)
                    const int ih_lo = qh_a + __ldg(rows_h + 4 * rh + 2) - (Th - 1) * hosh;
                    const int iw_lo = __ldg(rows_w + 4 * rw + 2) - (Tw - 1) * hosw;
                    // window offsets of this thread's two groups of 4 positions (a group past the
                    // tile reads row 0, which is loaded; the epilogue never reads its result)
                    int gb[2];
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int p = p0 + hh * (BM / 2) + 4 * tm;
                        const int qh = p / qcw;
                        gb[hh] = p < p1 ? (qh - qh_a) * hp + (p - qh * qcw) : 0;
                    }
                    auto load_stage = [&](int s, int buf) {
                        const int jdi = s / nchunks, ci0 = (s - jdi * nchunks) * BK;
                        const int id = dbase - (jd_lo + jdi) * osd;
                        float* const hs = As + buf * a.halo_stage;
                        float* const bs = hs + a.halo_a;
                        // int offsets: (ci, id, ih, iw) inside one group's input, < 2^31 (launcher)
                        const float* const xs = xg + id * a.H * a.W;
                        for (int t = warp; t < BK * nr; t += NWARPS) {
                            const int k = t / nr, r = t - k * nr;
                            const int ih = ih_lo + r;
                            const bool rok = ci0 + k < a.cin_g && static_cast<unsigned>(ih) < static_cast<unsigned>(a.H);
                            const float* const src = xs + (rok ? (ci0 + k) * cstride + ih * a.W : 0);
                            float* const dst = hs + k * hch + r * hp;
                            for (int c = lane; c < hp; c += 32) {
                                const int iw = iw_lo + c;
                                const bool ok = rok && static_cast<unsigned>(iw) < static_cast<unsigned>(a.W);
                                cp_async4(dst + c, ok ? src + iw : xg, ok);
                            }
                        }
                        const int4* const tp = taps + jdi * thw_n;
                        const int nvec = thw_n * BK * (BN / 4);
                        for (int v = tid; v < nvec; v += NT) {
                            const int row = v / (BN / 4), c4 = v - row * (BN / 4);  // row = t * BK + k
                            const int t = row / BK, k = row - t * BK;
                            cp_async16(bs + row * BN + 4 * c4,
                                       wpk + tp[t].w * wtap + static_cast<long long>(ci0 + k) * cout_pad + co_base + 4 * c4,
                                       true);
                        }
                    };

#pragma unroll
                    for (int s = 0; s < STAGES - 1; ++s) {
                        if (s < nsteps) load_stage(s, s);
                        cp_async_commit();
                    }
                    int cbuf = 0, lbuf = STAGES - 1;
                    for (int s = 0; s < nsteps; ++s) {
                        cp_async_wait<STAGES - 2>();  // this thread's copies of step s have landed
                        __syncthreads();              // everyone's have; everyone is done with step s - 1
                        if (s + STAGES - 1 < nsteps) load_stage(s + STAGES - 1, lbuf);
                        cp_async_commit();
                        lbuf = (lbuf + 1 == STAGES) ? 0 : lbuf + 1;
                        const float* const hs = As + cbuf * a.halo_stage;
                        // Width tap jw shifts the window by (Tw-1-jw)*osw columns: a compile-time
                        // step OSW (1-4; any with one width tap) makes the shift of each unrolled jw
                        // a register index, the tap count stays a run-time guard.
                        auto compute = [&](auto osw_c) {
                            constexpr int OSW = decltype(osw_c)::value;
                            constexpr int NJ = HALO_MAX_SHIFT / OSW + 1;  // width taps at most
                            const int rstep = hosh * hp;
                            const float* h0 = hs + gb[0] + (Th - 1) * rstep;
                            const float* h1 = hs + gb[1] + (Th - 1) * rstep;
                            // tap (jh, jw) at (jh*Tw + jw)*BK*BN; the shift-0 tap is jw = Tw - 1
                            const float* bk = hs + a.halo_a + 4 * tn + (Tw - 1) * BK * BN;
                            // fixed order per output: k, then jh, then jw from Tw - 1 down to 0
#pragma unroll 1
                            for (int k = 0; k < BK; ++k) {
                                const float* bj = bk;
#pragma unroll 1
                                for (int jh = 0; jh < Th; ++jh) {
                                    const float4 x00 = lds4(h0 - jh * rstep), x01 = lds4(h0 - jh * rstep + 4);
                                    const float4 x10 = lds4(h1 - jh * rstep), x11 = lds4(h1 - jh * rstep + 4);
                                    const float w0[8] = {x00.x, x00.y, x00.z, x00.w, x01.x, x01.y, x01.z, x01.w};
                                    const float w1[8] = {x10.x, x10.y, x10.z, x10.w, x11.x, x11.y, x11.z, x11.w};
#pragma unroll
                                    for (int j = 0; j < NJ; ++j) {
                                        if (j >= Tw) break;
                                        const float4 b0 = lds4(bj - j * BK * BN), b1 = lds4(bj - j * BK * BN + HBN);
                                        const float av[8] = {w0[j * OSW], w0[j * OSW + 1], w0[j * OSW + 2], w0[j * OSW + 3],
                                                             w1[j * OSW], w1[j * OSW + 1], w1[j * OSW + 2], w1[j * OSW + 3]};
                                        const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                                        for (int i = 0; i < 8; ++i)
#pragma unroll
                                            for (int jj = 0; jj < 8; ++jj) acc[i][jj] = __fmaf_rn(av[i], bv[jj], acc[i][jj]);
                                    }
                                    bj += Tw * BK * BN;
                                }
                                h0 += hch;
                                h1 += hch;
                                bk += BN;
                            }
                        };
                        switch (Tw == 1 ? 1 : hosw) {  // the launcher: (Tw-1)*osw <= HALO_MAX_SHIFT
                            case 1: compute(std::integral_constant<int, 1>{}); break;
                            case 2: compute(std::integral_constant<int, 2>{}); break;
                            case 3: compute(std::integral_constant<int, 3>{}); break;
                            default: compute(std::integral_constant<int, 4>{}); break;
                        }
                        cbuf = (cbuf + 1 == STAGES) ? 0 : cbuf + 1;
                    }
                }
                cp_async_wait<0>();
                __syncthreads();  // the pipeline buffers become the epilogue tile

                // ---- epilogue: compact rows qh in [qh_a, min(qh_b, Qh - 1)], output rows qh*sh + rh ----
                {
                    const long long plane = static_cast<long long>(a.OH) * a.OW, vol = plane * a.OD;
                    const long long od_off = static_cast<long long>(qd * sd + rd) * plane;
                    // This round also owes the width residues without taps if rw is the first with taps.
                    unsigned owed = 0;  // bit r: write residue r's bias (sw <= 32; else the table)
                    bool first = true;
                    for (int r = 0; r < rw; ++r) first = first && __ldg(rows_w + 4 * r) == 0;
                    if (first)
                        for (int r = 0; r < sw && r < 32; ++r)
                            if (__ldg(rows_w + 4 * r) == 0) owed |= 1u << r;
                    // lane j = lane + 32 t walks (residue j mod sw, compact j / sw) by carries
                    const int lr0 = lane % sw, lq0 = lane / sw, sr = 32 % sw, sq = 32 / sw;
                    const int nrows = min(qh_b, Qh - 1) - qh_a + 1;  // >= 1: qh_a < Qh
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        // channels h*HBN + cl, cl in [0, HBN)
                        if constexpr (MMA) {
                            // the warps of channel half wn == h: D[m][n] of tile (i, j), register r,
                            // at m = wm*64 + 16i + g + 8(r/2), cl = 8j + 2t + r%2 (32 distinct banks)
                            if (wn == h) {
#pragma unroll
                                for (int i = 0; i < 4; ++i)
#pragma unroll
                                    for (int j = 0; j < 4; ++j)
#pragma unroll
                                        for (int r = 0; r < 4; ++r)
                                            Cs[(8 * j + 2 * ft + (r & 1)) * CPITCH + wm * 64 + 16 * i + fg + 8 * (r >> 1)] =
                                                acc[2 * i + j / 2][4 * (j % 2) + r];
                            }
                        } else {
                            // this thread's channels are cl = 4tn + j
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                float* c = Cs + (4 * tn + j) * CPITCH + 4 * tm;
                                *reinterpret_cast<float4*>(c) = make_float4(acc[0][4 * h + j], acc[1][4 * h + j],
                                                                            acc[2][4 * h + j], acc[3][4 * h + j]);
                                *reinterpret_cast<float4*>(c + BM / 2) = make_float4(acc[4][4 * h + j], acc[5][4 * h + j],
                                                                                     acc[6][4 * h + j], acc[7][4 * h + j]);
                            }
                        }
                        __syncthreads();
                        for (int t = warp; t < nrows * HBN; t += NWARPS) {
                            const int r = t / HBN, cl = t - r * HBN;
                            const int co = co_base + h * HBN + cl;
                            if (co >= a.cout_g) continue;
                            const int qh = qh_a + r;
                            const int qw_a = (qh == qh_a) ? p0 - qh * qcw : 0;
                            const int qw_b = (qh == qh_b) ? p1 - qh * qcw : qcw;
                            const int ow_a = qw_a * sw;
                            const int len = ((qw_b == qcw) ? a.OW : min(a.OW, qw_b * sw)) - ow_a;
                            const float fv = a.has_bias ? __ldg(bias + g * a.cout_g + co) : 0.0f;
                            float* yr = y + (chan0 + co) * vol + od_off + static_cast<long long>(qh * sh + rh) * a.OW + ow_a;
                            const float* cr = Cs + cl * CPITCH + (qh * qcw + qw_a - p0);
                            int rr = lr0, jq = lq0;  // residue and compact offset of element j
                            for (int j = lane; j < len; j += 32) {
                                if (rr == rw) {
                                    yr[j] = cr[jq] + fv;
                                } else if (first && (sw <= 32 ? ((owed >> rr) & 1u) != 0 : __ldg(rows_w + 4 * rr) == 0)) {
                                    yr[j] = fv;
                                }
                                rr += sr;
                                jq += sq;
                                if (rr >= sw) {
                                    rr -= sw;
                                    ++jq;
                                }
                            }
                        }
                        __syncthreads();  // the tile is read: next, the other half or the next phase
                    }
                }
            }
        }
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

// gemm_kernel variants (indices after the phase_kernel ones): BN channels x BM positions per
// block, BK input channels per step, STAGES steps in flight, 256 threads of 8 x 8; HALO: the
// input window staged once per (depth tap, chunk) and reused across the (h, w) taps, where
// halo_layout() accepts the geometry (else the plain variant of the same BN, BK, STAGES: same
// weight packing).
struct GemmVariant {
    int BN, BK, STAGES, HALO, MMA;
};
constexpr int NUM_GEMM = 7;
constexpr GemmVariant GEMM_VARIANTS[NUM_GEMM] = {
    {64, 16, 3, 0, 0},  // 6: 64 channels x 256 positions, 16 input channels per step
    {32, 16, 3, 0, 0},  // 7: 32 channels x 512 positions, 16 input channels per step
    {64, 8, 3, 0, 0},   // 8: 64 channels x 256 positions, 8 input channels per step
    {64, 32, 2, 0, 0},  // 9: 64 channels x 256 positions, 32 input channels per step
    {64, 8, 3, 1, 0},   // 10: 64 channels x 256 positions, 8 input channels per step, halo window
    {64, 32, 2, 0, 1},  // 11: 64 channels x 256 positions, 32 input channels per step, tensor cores (TF32)
    {64, 16, 3, 0, 1},  // 12: 64 channels x 256 positions, 16 input channels per step, tensor cores (TF32)
};
constexpr int MMA_PAD = 8;  // gemm_kernel's stage row padding of its MMA form (floats)
// Shared memory of a HALO block at most: two blocks per SM on H100/H200 (228 KB, 1 KB reserved
// per block), so 16 warps hide the window loads as in the plain tiles (KB 77: 88 KB).
constexpr long long HALO_SMEM_MAX = 110 * 1024;

// The HALO window of gemm_kernel variant v: fills a.halo_* and a.region and returns the dynamic
// shared memory bytes, or 0 where the variant does not apply (qcw not a multiple of 4, a width
// shift over HALO_MAX_SHIFT, or more than HALO_SMEM_MAX bytes). Mirrors cuda_engine.halo_layout.
static long long halo_layout(const GemmVariant& v, Args& a, int halo_h, int halo_w, int max_thw, long long taps) {
    const int bm = 8 * (GEMM_THREADS / (v.BN / 8));
    if (a.qcw % 4 != 0 || halo_w > HALO_MAX_SHIFT) return 0;
    int g = bm, r = a.qcw;  // gcd(bm, qcw): a tile starts at a multiple of it within its row
    while (r != 0) { const int t = g % r; g = r; r = t; }
    // compact rows one tile of bm flattened positions touches, at most
    const long long trows = std::min<long long>(a.qch, (bm - 1 + a.qcw - g) / a.qcw + 1);
    const long long hp = a.qcw + HALO_MAX_SHIFT;
    const long long hch = (trows + halo_h) * hp;
    const long long ha = static_cast<long long>(v.BK) * hch;
    const long long hst = ha + static_cast<long long>(max_thw) * v.BK * v.BN;
    const long long region = std::max<long long>(v.STAGES * hst, static_cast<long long>(v.BN / 2) * (bm + 4));
    const long long bytes = 4 * region + 16 * taps;
    if (bytes > HALO_SMEM_MAX) return 0;
    a.halo_pitch = static_cast<int>(hp); a.halo_ch = static_cast<int>(hch); a.halo_a = static_cast<int>(ha);
    a.halo_stage = static_cast<int>(hst); a.region = static_cast<int>(region);
    return bytes;
}

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

template <int BN, int BK, int STAGES, bool HALO = false, bool MMA = false>
void launch_gemm(const torch::Tensor& x, const torch::Tensor& wpk, const float* bias, torch::Tensor& y,
                 const torch::Tensor& tab, const Args& a, long long blocks, size_t smem, cudaStream_t stream) {
    auto kernel = gemm_kernel<BN, BK, STAGES, 2, HALO, MMA>;
    TORCH_CHECK(blocks >= 1 && blocks <= 0x7fffffffLL, "convt3d cuda: gemm_kernel grid of ", blocks, " blocks");
    if (smem > 48 * 1024) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(blocks), GEMM_THREADS, smem, stream>>>(
        x.data_ptr<float>(), wpk.data_ptr<float>(), bias, y.data_ptr<float>(), tab.data_ptr<int>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A TF32-rounded copy of a contiguous fp32 tensor (see to_tf32).
torch::Tensor rounded_tf32(const torch::Tensor& t, cudaStream_t stream) {
    auto out = torch::empty_like(t);
    const long long n = t.numel();
    if (n == 0) return out;
    // one element per thread up to 2^20 blocks; the grid-stride loop covers larger tensors
    const long long grid = std::min<long long>((n + 255) / 256, 1LL << 20);
    round_tf32_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(t.data_ptr<float>(), out.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

// meta: N, G, cin_g, cout_g, D, H, W, OD, OH, OW, KD, KH, KW, qcd, qch, qcw, halo_h, halo_w, max_thw,
//       sd, sh, sw, pd, ph, pw, dd, dh, dw
// variant: 0..NUM_VARIANTS-1 (phase_kernel), NUM_VARIANTS..NUM_VARIANTS+NUM_GEMM-1 (gemm_kernel), or
// -1 for the direct kernel. hreuse: allow the H-reuse inner loop (phase_kernel only). tf32: round
// the input and the packed weight to TF32 first (the file's header comment: TF32 mode).
// Returns the NCDHW output.
torch::Tensor forward(torch::Tensor x, torch::Tensor wpk, torch::Tensor bias, bool has_bias, torch::Tensor tab,
                      std::vector<int64_t> meta, int64_t variant, bool hreuse, bool tf32) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous CUDA float32");
    TORCH_CHECK(wpk.is_cuda() && wpk.scalar_type() == torch::kFloat32 && wpk.is_contiguous(), "packed weight");
    TORCH_CHECK(tab.is_cuda() && tab.scalar_type() == torch::kInt32, "table: CUDA int32");
    TORCH_CHECK(meta.size() == 28, "meta: 28 values");
    TORCH_CHECK(variant >= -1 && variant < NUM_VARIANTS + NUM_GEMM, "variant out of range");
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
    if (tf32) {
        // fresh rounded copies: the caller's tensors are never written
        x = rounded_tf32(x, stream);
        wpk = rounded_tf32(wpk, stream);
    }

    long long blocks = 0;
    size_t smem = 0;
    if (variant >= NUM_VARIANTS) {
        const GemmVariant v = GEMM_VARIANTS[variant - NUM_VARIANTS];
        const int bm = 8 * (GEMM_THREADS / (v.BN / 8));
        const long long plane_q = static_cast<long long>(a.qch) * a.qcw;
        a.tiles_hw = static_cast<int>(std::min<long long>((plane_q + bm - 1) / bm, 0x7fffffffLL));
        a.tiles_co = (a.cout_g + v.BN - 1) / v.BN;
        blocks = static_cast<long long>(a.tiles_co) * a.tiles_hw * a.qcd * a.N * a.G;
        // pipeline buffers and epilogue tile (one region, the larger), then the phase's tap table
        const long long taps = static_cast<long long>(a.KD) * a.KH * a.KW;
        const long long pad = v.MMA ? 2 * MMA_PAD : 0;  // the MMA form's padded stage rows
        const long long region = std::max<long long>(static_cast<long long>(v.STAGES) * v.BK * (bm + v.BN + pad),
                                                     static_cast<long long>(v.BN / 2) * (bm + 4));
        smem = static_cast<size_t>(4LL * region + 16LL * taps);
        // 32-bit position and input-offset arithmetic in the kernel, a bounded tap table. The Python
        // side (cuda_engine.gemm_applies) asks for the direct kernel instead where these fail.
        TORCH_CHECK(blocks <= 0x7fffffffLL && plane_q + bm <= 0x7fffffffLL &&
                        static_cast<long long>(a.cin_g) * a.D * a.H * a.W <= 0x7fffffffLL && taps <= GEMM_MAX_TAPS,
                    "convt3d cuda: sizes outside gemm_kernel's limits (use the direct variant)");
        const int pad_ci = (a.cin_g + v.BK - 1) / v.BK * v.BK, pad_co = a.tiles_co * v.BN;
        TORCH_CHECK(wpk.numel() == static_cast<long long>(a.G) * taps * pad_ci * pad_co,
                    "convt3d cuda: gemm_kernel needs the padded weight packing (cuda_engine.pack_weight_padded)");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(wpk.data_ptr<float>()) % 16 == 0,
                    "convt3d cuda: gemm_kernel reads the packed weight as float4 (16-byte aligned)");
        // the tensor cores read TF32 operands: only the TF32 mode's rounded copies are exact for them
        TORCH_CHECK(!v.MMA || tf32, "convt3d cuda: the tensor-core gemm variants run in TF32 mode only");
        if (v.HALO) {
            const long long hbytes = halo_layout(v, a, halo_h, halo_w, max_thw, taps);
            if (hbytes > 0) {
                smem = static_cast<size_t>(hbytes);
            } else {  // outside the window's limits: the plain tile of the same shape (same packing)
                for (int i = 0; i < NUM_GEMM; ++i) {
                    const GemmVariant& u = GEMM_VARIANTS[i];
                    if (!u.HALO && !u.MMA && u.BN == v.BN && u.BK == v.BK && u.STAGES == v.STAGES) variant = NUM_VARIANTS + i;
                }
                TORCH_CHECK(!GEMM_VARIANTS[variant - NUM_VARIANTS].HALO, "convt3d cuda: no plain tile for a halo variant");
            }
        }
    } else if (variant >= 0) {
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
        case 6: launch_gemm<64, 16, 3>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 7: launch_gemm<32, 16, 3>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 8: launch_gemm<64, 8, 3>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 9: launch_gemm<64, 32, 2>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 10: launch_gemm<64, 8, 3, true>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 11: launch_gemm<64, 32, 2, false, true>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
        case 12: launch_gemm<64, 16, 3, false, true>(x, wpk, bptr, y, tab, a, blocks, smem, stream); break;
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
                              torch::Tensor tab, std::vector<int64_t> meta, int64_t variant, bool hreuse,
                              bool tf32) {
    return convt3d_cuda::forward(x, wpk, bias, has_bias, tab, meta, variant, hreuse, tf32);
}
#else
// Standalone compile check (nvcc -DCONVT3D_KERNELS_ONLY): instantiate every variant.
template __global__ void convt3d_cuda::phase_kernel<8, 16, 1, 4, (1 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<4, 16, 2, 4, (2 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 8, 2, 4, (2 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<16, 8, 1, 4, (1 * 4 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 8, 4, 2, (4 * 2 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::phase_kernel<8, 4, 4, 1, (4 * 1 * 32 >= 256 ? 1 : 2)>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 16, 3, 2>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<32, 16, 3, 2>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 8, 3, 2>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 32, 2, 2>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 8, 3, 2, true>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 32, 2, 2, false, true>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
template __global__ void convt3d_cuda::gemm_kernel<64, 16, 3, 2, false, true>(const float*, const float*, const float*, float*, const int*, const convt3d_cuda::Args);
#endif
