// convt3d's CUDA head kernel: output heads (few output channels per group) at dilation 1 in one launch; the
// launcher, engines/cuda/head.py, computes every size below. Tap t = j * s + r (shift j < J = ceil(k/s), residue
// r < s) makes output block q Y[q][(r, co)] = bias[co] + sum_{j, ci} X[q - j][ci] * Wj[ci][(r, co)]: a GEMM with
// M = output blocks, N = residues x Cout/g (padded to 8), K = shifts x Cin/g. A persistent CTA walks boxes of
// output blocks, staging per chunk of KC input channels the box plus its J - 1 halo in shared memory once; every
// shift reads its A fragments there by ldmatrix at a run-time row offset, which Triton cannot express. The row
// pitch RP = RB + 16 bytes starts any 8 consecutive rows in 8 bank groups whatever the shift (an XOR swizzle's key
// would change with it). Variant jn > 1 takes the width shifts as MMA columns, one A fragment feeding jn MMAs.
// Two stages stage the next (tile, chunk) while this one multiplies, across tiles too. fp32 is rounded to TF32
// once, when staged; the epilogue goes through shared memory so that consecutive lanes write each output row.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int MAX_SHIFTS = 64;  // J_d x J_h x J_w (the launcher refuses more)

struct HeadArgs {
  int64_t sx[5];          // input strides (n, c, d, h, w), elements
  int64_t sy[5];          // output strides
  int in[3], out[3], st[3], pad[3];
  int js[3];              // shifts per dimension taken as K steps (J_w is 1 where they are columns)
  int q0[3];              // first block of the output: pad / stride
  int bt[3];              // output blocks per CTA tile (BD, BH, and BW - jn + 1 along W)
  int tiles[3];           // tiles per dimension
  int hb[3];              // staged input box: bt + js - 1 (mw + js - 1 along W)
  int jn;                 // width shifts as columns (1: none; else J_w, and js[2] is 1)
  int mw;                 // the M rows' extent along W: bt[2] + jn - 1
  int rc;                 // columns of one width shift: residues x cout_g
  int cin_g, cout_g, groups;
  int np;                 // columns, residues x cout_g rounded up to 8
  int nchunks, kc, ch;    // channel chunks, channels per chunk, 16-byte units per row
  int jtot, hr;           // shifts, staged input rows (hb product)
  int total;              // tiles of the launch: batch x groups x tiles[0] x tiles[1] x tiles[2]
  int mode;               // input staging: 0 cp.async 16 B units, 1 cp.async 4 B elements, 2 registers
  int stages;             // 1, or 2 (the next (tile, chunk) staged while this one is multiplied)
  int wres;               // 1: every chunk's weights staged once per CTA (one group); 0: with each chunk
  int stage_bytes;        // one stage: input rows, plus the chunk's weight rows where wres is 0
  int w_off, rtab_off, etab_off, cs_off;  // shared-memory regions; cs_off < 0: the stage just read
  // multiply-high reciprocals ceil(2^32 / d) of run-time divisors: exact while n x d < 2^32 (n < 2^17, d < 2^13)
  uint32_t m_hb2, m_hb1, m_hr, m_mw, m_bt1, m_st[3], m_len[3], m_cout;
  int shoff[MAX_SHIFTS];          // per shift: its byte offset in the staged rows, ((jd hb1 + jh) hb2 + jw) RP
  unsigned ntmask[MAX_SHIFTS];    // per shift: the n-tiles any of its taps feeds
};

// m = 0 stands for d = 1
__device__ __forceinline__ int fdiv(int n, uint32_t m) { return m ? (int)__umulhi((uint32_t)n, m) : n; }

template <typename T> struct Raw { using type = uint16_t; };
template <> struct Raw<float> { using type = uint32_t; };

// fp32 bits -> the nearest TF32 value (ties away from zero, as cvt.rna.tf32), inf and NaN kept.
__device__ __forceinline__ uint32_t tf32_round(uint32_t bits) {
  return (bits & 0x7f800000u) == 0x7f800000u ? bits : (bits + 0x1000u) & 0xffffe000u;
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// cp.async with zero fill: src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* g, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t saddr, const void* g, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(saddr), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same<T, float>::value) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Staged rows of CH 16-byte units at a pitch of RP = RB + 16; LOG = log2(CH).
template <int CH>
struct Rows {
  static_assert(CH == 2 || CH == 4 || CH == 8, "rows of 32, 64 or 128 bytes");
  static constexpr int RB = CH * 16;
  static constexpr int RP = RB + 16;
  static constexpr int LOG = CH == 8 ? 3 : (CH == 4 ? 2 : 1);
};

// A tile's place; the next tile is `grid` on, added digit by digit with carries (no divisions).
struct TilePos {
  int w, h, d, g, n;
};

__device__ __forceinline__ TilePos tile_pos(const HeadArgs& a, int t) {
  TilePos p;
  p.w = t % a.tiles[2]; t /= a.tiles[2];
  p.h = t % a.tiles[1]; t /= a.tiles[1];
  p.d = t % a.tiles[0]; t /= a.tiles[0];
  p.g = t % a.groups;
  p.n = t / a.groups;
  return p;
}

__device__ __forceinline__ TilePos tile_add(const HeadArgs& a, TilePos p, const TilePos& s) {
  int c;
  p.w += s.w; c = p.w >= a.tiles[2]; p.w -= c ? a.tiles[2] : 0;
  p.h += s.h + c; c = p.h >= a.tiles[1]; p.h -= c ? a.tiles[1] : 0;
  p.d += s.d + c; c = p.d >= a.tiles[0]; p.d -= c ? a.tiles[0] : 0;
  p.g += s.g + c; c = p.g >= a.groups; p.g -= c ? a.groups : 0;
  p.n += s.n + c;
  return p;
}

// Each staged row's input offset within the batch element and group, or -1 outside the input.
__device__ __forceinline__ void fill_rtab(int64_t* rtab, const HeadArgs& a, const TilePos& p) {
  const int i0d = a.q0[0] + p.d * a.bt[0] - (a.js[0] - 1);  // block q reads q - j: J - 1 inputs before
  const int i0h = a.q0[1] + p.h * a.bt[1] - (a.js[1] - 1);
  const int i0w = a.q0[2] + p.w * a.bt[2] - (a.jn - 1) - (a.js[2] - 1);  // the M rows start jn - 1 before
  for (int row = threadIdx.x; row < a.hr; row += blockDim.x) {
    const int t = fdiv(row, a.m_hb2);
    const int hw = row - t * a.hb[2];
    const int hd = fdiv(t, a.m_hb1);
    const int hh = t - hd * a.hb[1];
    const int id = i0d + hd, ih = i0h + hh, iw = i0w + hw;
    const bool in = (unsigned)id < (unsigned)a.in[0] && (unsigned)ih < (unsigned)a.in[1] &&
                    (unsigned)iw < (unsigned)a.in[2];
    rtab[row] = in ? (int64_t)id * a.sx[2] + (int64_t)ih * a.sx[3] + (int64_t)iw * a.sx[4] : -1;
  }
}

// The weights of one chunk and group, staged as rows j x BN + n (rows past np zero).
template <typename T, int CH, int BN>
__device__ __forceinline__ void stage_weights(const T* __restrict__ wp, uint32_t dst, const HeadArgs& a, int grp,
                                              int chunk) {
  constexpr int V = 16 / sizeof(T);
  constexpr int LOG = Rows<CH>::LOG, RP = Rows<CH>::RP;
  const int c = threadIdx.x & (CH - 1);
  const T* wc = wp + ((int64_t)grp * a.nchunks + chunk) * (int64_t)a.jtot * a.np * a.kc + c * V;
  const int wrows = a.jtot * BN;
  for (int row = threadIdx.x >> LOG; row < wrows; row += blockDim.x >> LOG) {
    const int j = row / BN;  // BN is a power of two
    const int n = row - j * BN;
    const bool ok = n < a.np;
    cp_async16(dst + row * RP + c * 16, ok ? wc + (int64_t)(j * a.np + n) * a.kc : wp, ok ? 16 : 0);
  }
}

// Stage one input channel chunk of the tile's box (zeros past Cin/g; the caller commits and waits). Modes: 0, 16-byte
// cp.async per unit (channels contiguous, aligned); 1, fp32 by 4-byte cp.async; 2, 16-bit loads, 16-byte stores.
template <typename T, int CH>
__device__ __forceinline__ void stage_input(const T* __restrict__ x, char* dst, const int64_t* rtab,
                                            const HeadArgs& a, int64_t xbase, int chunk) {
  using R = typename Raw<T>::type;
  constexpr int V = 16 / sizeof(T);
  constexpr int RP = Rows<CH>::RP;
  const uint32_t as = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int cbase = chunk * a.kc;
  if (a.mode == 0) {
    constexpr int LOG = Rows<CH>::LOG;
    const int c = threadIdx.x & (CH - 1);
    const int ci0 = cbase + c * V;
    const bool cok = ci0 < a.cin_g;
    const T* xc = x + xbase + ci0;
    const int step = blockDim.x >> LOG;
    for (int row = threadIdx.x >> LOG; row < a.hr; row += step) {
      const int64_t off = rtab[row];
      const bool ok = cok && off >= 0;
      cp_async16(as + row * RP + c * 16, ok ? xc + off : x, ok ? 16 : 0);
    }
  } else if (a.mode == 1) {
    const int elems = a.hr * CH * V;
    for (int u = threadIdx.x; u < elems; u += blockDim.x) {
      const int ce = fdiv(u, a.m_hr);  // channel within the chunk
      const int row = u - ce * a.hr;
      const int ci = cbase + ce;
      const int64_t off = rtab[row];
      const bool ok = off >= 0 && ci < a.cin_g;
      const T* p = ok ? x + xbase + off + (int64_t)ci * a.sx[1] : x;
      cp_async4(as + row * RP + ce * 4, p, ok ? 4 : 0);
    }
  } else {
    const R* xr = reinterpret_cast<const R*>(x);
    const int units = a.hr * CH;
    for (int u0 = threadIdx.x; u0 < units; u0 += 4 * blockDim.x) {
      uint32_t w[4][4];
      int dsto[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int u = u0 + q * blockDim.x;
        const int uc = fdiv(u, a.m_hr);
        const int row = u - uc * a.hr;
        const int ci0 = cbase + uc * V;
        const int64_t off = u < units ? rtab[row] : -1;
        dsto[q] = u < units ? row * RP + uc * 16 : -1;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t word = 0u;
#pragma unroll
          for (int h = 0; h < V / 4; ++h) {
            const int ci = ci0 + k * (V / 4) + h;
            const uint32_t e = (off >= 0 && ci < a.cin_g)
                                   ? (uint32_t)__ldg(xr + xbase + off + (int64_t)ci * a.sx[1]) : 0u;
            word |= e << (16 * h);
          }
          w[q][k] = word;
        }
      }
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (dsto[q] >= 0) *reinterpret_cast<uint4*>(dst + dsto[q]) = make_uint4(w[q][0], w[q][1], w[q][2], w[q][3]);
    }
  }
}

// fp32: round the input this thread staged to TF32 in place, before the barrier that publishes it.
template <int CH>
__device__ __forceinline__ void round_input(char* dst, const HeadArgs& a) {
  constexpr int RP = Rows<CH>::RP;
  if (a.mode == 0) {
    constexpr int LOG = Rows<CH>::LOG;
    const int c = threadIdx.x & (CH - 1);
    const int step = blockDim.x >> LOG;
    for (int row = threadIdx.x >> LOG; row < a.hr; row += step) {
      uint4* q = reinterpret_cast<uint4*>(dst + row * RP + c * 16);
      uint4 v = *q;
      v.x = tf32_round(v.x); v.y = tf32_round(v.y); v.z = tf32_round(v.z); v.w = tf32_round(v.w);
      *q = v;
    }
  } else {
    const int elems = a.hr * CH * 4;
    for (int u = threadIdx.x; u < elems; u += blockDim.x) {
      const int ce = fdiv(u, a.m_hr);
      const int row = u - ce * a.hr;
      uint32_t* q = reinterpret_cast<uint32_t*>(dst + row * RP + ce * 4);
      *q = tf32_round(*q);
    }
  }
}

__device__ __forceinline__ int64_t xbase_of(const HeadArgs& a, const TilePos& p) {
  return (int64_t)p.n * a.sx[0] + (int64_t)p.g * a.cin_g * a.sx[1];
}

// Stage the next (tile, chunk) item into stage `nbuf`; row-offset tables alternate by tile.
template <typename T, int CH, int BN>
__device__ __forceinline__ void stage_next(const T* __restrict__ x, const T* __restrict__ wp, char* smem,
                                           const HeadArgs& a, const TilePos& cur, const TilePos& step,
                                           TilePos& nxt, int64_t* rtab0, int tcount, int chunk, int nbuf) {
  constexpr int RP = Rows<CH>::RP;
  int64_t* nrt = rtab0 + (tcount & 1) * a.hr;
  int nchunk = chunk + 1;
  TilePos np = cur;
  if (nchunk == a.nchunks) {
    nxt = tile_add(a, cur, step);
    np = nxt;
    nrt = rtab0 + ((tcount + 1) & 1) * a.hr;
    nchunk = 0;
    fill_rtab(nrt, a, nxt);
    __syncthreads();
  }
  char* dst = smem + nbuf * a.stage_bytes;
  stage_input<T, CH>(x, dst, nrt, a, xbase_of(a, np), nchunk);
  if (!a.wres)
    stage_weights<T, CH, BN>(wp, static_cast<uint32_t>(__cvta_generic_to_shared(dst)) + a.hr * RP, a, np.g, nchunk);
  cp_async_commit();
}

// A CTA tile: BM = WM x MT x 16 output blocks by BN = WN x NTW x 8 columns; CH, a template parameter, unrolls K steps.
template <typename T, int CH, int MT, int NTW, int WM, int WN>
__global__ void __launch_bounds__(WM * WN * 32)
head_shuffle_kernel(const T* __restrict__ x, const T* __restrict__ wp, const T* __restrict__ bias,
                    T* __restrict__ y, const HeadArgs a) {
  constexpr bool F32 = std::is_same<T, float>::value;
  constexpr int BN = WN * NTW * 8;
  constexpr int CP = BN + 4;  // fp32 pitch of the epilogue's staging rows
  constexpr int RP = Rows<CH>::RP;
  extern __shared__ __align__(128) char smem[];
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const int lane = threadIdx.x & 31;
  // the warp index through a shuffle: ptxas then knows it warp-uniform (no WARPSYNC before a masked MMA)
  const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
  const int wm = WN == 1 ? warp : warp % WM;
  const int wn = WN == 1 ? 0 : warp / WM;  // a compile-time 0 for one warp column: the shift masks stay uniform
  const int nt0 = wn * NTW;
  const int a_bytes = a.hr * RP;
  const int w_chunk_bytes = a.jtot * BN * RP;

  // Once per CTA: each lane's ldmatrix row offset at shift 0, per m-tile.
  uint32_t lane_a[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m = (wm * MT + mt) * 16 + (lane & 15);
    const int r = fdiv(m, a.m_mw);
    const int lw = m - r * a.mw;
    const int ld = fdiv(r, a.m_bt1);
    const int lh = r - ld * a.bt[1];
    const int row = ((ld + a.js[0] - 1) * a.hb[1] + lh + a.js[1] - 1) * a.hb[2] + lw + a.js[2] - 1;
    lane_a[mt] = (uint32_t)(row * RP + ((lane >> 4) << 4));
  }
  const uint32_t lane_b = (uint32_t)((nt0 * 8 + (lane & 7) + ((lane >> 4) << 3)) * RP + (((lane >> 3) & 1) << 4));
  // The output channel of each accumulator column (-1: padding).
  const int g8 = lane >> 2, t4 = lane & 3;
  int bco[NTW][2];
#pragma unroll
  for (int i = 0; i < NTW; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = (nt0 + i) * 8 + 2 * t4 + e;
      bco[i][e] = n < a.rc ? n - fdiv(n, a.m_cout) * a.cout_g : -1;  // once: the columns of width shift 0
    }

  // Epilogue: columns are widths (NCDHW) or (width, channel) pairs (channels-last).
  const int sd = a.st[0], sh = a.st[1], sw = a.st[2];
  const int ld_len = a.bt[0] * sd, lh_len = a.bt[1] * sh, lw_len = a.bt[2] * sw;
  const int cout_g = a.cout_g;
  const bool cl_out = a.sy[1] == 1 && a.sy[4] != 1;
  const int cols = cl_out ? lw_len * cout_g : lw_len;
  const int jstep = a.rc - CP;  // from width shift jw to jw + 1 in the epilogue tile: a row up, rc columns on
  const int erows = cl_out ? ld_len * lh_len : cout_g * ld_len * lh_len;
  const int per_row = cols < (int)blockDim.x ? cols : (int)blockDim.x;
  const int row_step = blockDim.x / per_row;
  const int r0 = threadIdx.x / per_row;
  // Row table: shared-memory offset, output offset and local (depth, height) of each row.
  int4* etab = reinterpret_cast<int4*>(smem + a.etab_off);
  for (int r = threadIdx.x; r < erows; r += blockDim.x) {
    const int t = fdiv(r, a.m_len[1]);
    const int ohl = r - t * lh_len;
    const int co_r = fdiv(t, a.m_len[0]);
    const int odl = t - co_r * ld_len;
    const int lh = fdiv(ohl, a.m_st[1]), rh = ohl - lh * sh;
    const int ldd = fdiv(odl, a.m_st[0]), rd = odl - ldd * sd;
    const int cs = (ldd * a.bt[1] + lh) * a.mw * CP + (rd * sh + rh) * sw * cout_g + co_r;
    const int64_t yo = (int64_t)co_r * a.sy[1] + (int64_t)odl * a.sy[2] + (int64_t)ohl * a.sy[3];
    etab[r] = make_int4(cs, (odl << 16) | ohl, (int)(uint32_t)(uint64_t)yo, (int)(uint32_t)((uint64_t)yo >> 32));
  }

  int64_t* const rtab0 = reinterpret_cast<int64_t*>(smem + a.rtab_off);

  float acc[MT][NTW][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NTW; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.f;
  const unsigned warp_bits = (1u << NTW) - 1u;

  int tile = blockIdx.x;
  if (tile >= a.total) return;  // the launcher starts at most `total` CTAs
  const TilePos step = tile_pos(a, (int)gridDim.x);
  TilePos cur = tile_pos(a, tile);
  TilePos nxt = cur;

  if (a.wres)
    for (int c = 0; c < a.nchunks; ++c) stage_weights<T, CH, BN>(wp, smem_u32 + a.w_off + c * w_chunk_bytes, a, 0, c);
  fill_rtab(rtab0, a, cur);
  __syncthreads();
  stage_input<T, CH>(x, smem, rtab0, a, xbase_of(a, cur), 0);
  if (!a.wres) stage_weights<T, CH, BN>(wp, smem_u32 + a_bytes, a, cur.g, 0);
  cp_async_commit();

  int item = 0;   // (tile, chunk) items of this CTA so far: the stage parity
  int tcount = 0; // tiles of this CTA so far: the row-table parity
  for (;;) {
    const bool more = (int64_t)tile + gridDim.x < a.total;
    for (int chunk = 0; chunk < a.nchunks; ++chunk, ++item) {
      const int buf = a.stages == 2 ? (item & 1) : 0;
      const bool last = chunk + 1 == a.nchunks;
      const bool has_next = !last || more;
      if (a.stages == 2 && has_next) {
        stage_next<T, CH, BN>(x, wp, smem, a, cur, step, nxt, rtab0, tcount, chunk, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      if constexpr (F32) round_input<CH>(smem + buf * a.stage_bytes, a);
      __syncthreads();

      const uint32_t sbase = smem_u32 + buf * a.stage_bytes;
      const uint32_t wbase = (a.wres ? smem_u32 + a.w_off + chunk * w_chunk_bytes : sbase + a_bytes) + lane_b;
      // A shift's K steps; `all`: every n-tile of the warp has a tap, so no predicate.
      auto shift_mma = [&](auto all, uint32_t arow0, uint32_t brow, unsigned bits) {
#pragma unroll
        for (int ks = 0; ks < CH / 2; ++ks) {
          uint32_t b[NTW][2];
#pragma unroll
          for (int i = 0; i + 1 < NTW; i += 2) {
            uint32_t r[4];
            ldsm_x4(r, brow + i * 8 * RP + 32 * ks);
            b[i][0] = r[0]; b[i][1] = r[1]; b[i + 1][0] = r[2]; b[i + 1][1] = r[3];
          }
          if constexpr (NTW % 2 == 1) {
            uint32_t r[2];
            ldsm_x2(r, brow + (NTW - 1) * 8 * RP + 32 * ks);
            b[NTW - 1][0] = r[0]; b[NTW - 1][1] = r[1];
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t af[4];
            ldsm_x4(af, arow0 + lane_a[mt] + 32 * ks);
#pragma unroll
            for (int i = 0; i < NTW; ++i)
              if (decltype(all)::value || ((bits >> i) & 1u)) mma<T>(acc[mt][i], af, b[i]);
          }
        }
      };
      for (int j = 0; j < a.jtot; ++j) {
        const unsigned bits = (a.ntmask[j] >> nt0) & warp_bits;
        if (bits == 0u) continue;  // no tap of this shift feeds this warp's columns
        const uint32_t arow0 = sbase - (uint32_t)a.shoff[j];
        const uint32_t brow = wbase + (uint32_t)(j * BN * RP);
        if (bits == warp_bits)
          shift_mma(std::true_type{}, arow0, brow, bits);
        else
          shift_mma(std::false_type{}, arow0, brow, bits);
      }

      if (last) {
        // Epilogue: accumulators plus bias to shared memory, then whole output rows per lane group.
        __syncthreads();
        float* Cs = reinterpret_cast<float*>(smem + (a.cs_off >= 0 ? a.cs_off : buf * a.stage_bytes));
        float bv[NTW][2];
#pragma unroll
        for (int i = 0; i < NTW; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            bv[i][e] = (bias != nullptr && bco[i][e] >= 0) ? to_float<T>(bias[cur.g * cout_g + bco[i][e]]) : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int m = (wm * MT + mt) * 16 + g8;
#pragma unroll
          for (int i = 0; i < NTW; ++i) {
            const int n = (nt0 + i) * 8 + 2 * t4;
            *reinterpret_cast<float2*>(Cs + m * CP + n) =
                make_float2(acc[mt][i][0] + bv[i][0], acc[mt][i][1] + bv[i][1]);
            *reinterpret_cast<float2*>(Cs + (m + 8) * CP + n) =
                make_float2(acc[mt][i][2] + bv[i][0], acc[mt][i][3] + bv[i][1]);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.f;
          }
        }
        __syncthreads();
        const int qd0 = a.q0[0] + cur.d * a.bt[0], qh0 = a.q0[1] + cur.h * a.bt[1], qw0 = a.q0[2] + cur.w * a.bt[2];
        const int od0 = qd0 * sd - a.pad[0], oh0 = qh0 * sh - a.pad[1], ow0 = qw0 * sw - a.pad[2];
        const int64_t ybase = (int64_t)cur.n * a.sy[0] + (int64_t)cur.g * cout_g * a.sy[1] +
                              (int64_t)od0 * a.sy[2] + (int64_t)oh0 * a.sy[3];
        // JN: the width shifts summed per element, a compile-time constant for 1-3 (0: a.jn).
        auto store_rows = [&](auto jnc) {
          constexpr int JN = decltype(jnc)::value;
          for (int col = threadIdx.x - r0 * per_row; col < cols; col += per_row) {
            int owl = col, co_c = 0;
            if (cl_out) {
              owl = fdiv(col, a.m_cout);
              co_c = col - owl * cout_g;
            }
            const int ow = ow0 + owl;
            if ((unsigned)ow >= (unsigned)a.out[2]) continue;
            const int lw = fdiv(owl, a.m_st[2]);
            const int rw = owl - lw * sw;
            // Block lw takes width shift jw from M row lw + jn - 1 - jw, columns jw x rc on.
            const float* cs_col = Cs + (lw + a.jn - 1) * CP + rw * cout_g + co_c;
            T* y_col = y + ybase + (int64_t)ow * a.sy[4] + (int64_t)co_c * a.sy[1];
            for (int r = r0; r < erows; r += row_step) {
              const int4 e = etab[r];
              const int od = od0 + (e.y >> 16), oh = oh0 + (e.y & 0xffff);
              if ((unsigned)od >= (unsigned)a.out[0] || (unsigned)oh >= (unsigned)a.out[1]) continue;
              const int64_t yo = (int64_t)(((uint64_t)(uint32_t)e.w << 32) | (uint32_t)e.z);
              float v = cs_col[e.x];
              if constexpr (JN == 0) {
                for (int jw = 1; jw < a.jn; ++jw) v += cs_col[e.x + jw * jstep];
              } else {
#pragma unroll
                for (int jw = 1; jw < JN; ++jw) v += cs_col[e.x + jw * jstep];
              }
              y_col[yo] = from_float<T>(v);
            }
          }
        };
        if (r0 < row_step) {
          if (a.jn == 1) store_rows(std::integral_constant<int, 1>{});
          else if (a.jn == 2) store_rows(std::integral_constant<int, 2>{});
          else if (a.jn == 3) store_rows(std::integral_constant<int, 3>{});
          else store_rows(std::integral_constant<int, 0>{});
        }
      }
      __syncthreads();  // this stage (and the epilogue tile) is read; the next staging may overwrite it
      if (a.stages == 1 && has_next) stage_next<T, CH, BN>(x, wp, smem, a, cur, step, nxt, rtab0, tcount, chunk, 0);
    }
    if (!more) break;
    cur = nxt;
    tile += gridDim.x;
    ++tcount;
  }
  cp_async_wait<0>();  // nothing is in flight here; kept so a CTA never exits with copies pending
}

// Tile configurations: index -> (MT, NTW, WM, WN), the same table as head.py's CONFIGS.
#define CONVT3D_HEAD_CONFIGS(X) \
  X(0, 4, 1, 4, 1)  /* BM 256, BN 8 */ \
  X(1, 4, 2, 4, 1)  /* BM 256, BN 16 */ \
  X(2, 2, 4, 4, 1)  /* BM 128, BN 32 */ \
  X(3, 2, 4, 4, 2)  /* BM 128, BN 64 */ \
  X(4, 2, 4, 2, 4)  /* BM 64, BN 128 */ \
  X(5, 2, 1, 4, 1)  /* BM 128, BN 8 */ \
  X(6, 2, 2, 4, 1)  /* BM 128, BN 16 */

// The persistent grid: as many CTAs as the SMs hold, at most one per tile; `max_ctas` > 0 caps it.
template <typename K>
cudaError_t grid_for(K kern, int threads, size_t smem, int total, int max_ctas, int* grid) {
  int dev = 0, sms = 0, fit = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kern, threads, smem);
  if (err != cudaSuccess) return err;
  if (fit < 1) return cudaErrorInvalidConfiguration;
  int64_t g = (int64_t)fit * sms;
  if (max_ctas > 0 && max_ctas < g) g = max_ctas;
  *grid = (int)(g < total ? g : total);
  return cudaSuccess;
}

template <typename T, int CH>
cudaError_t launch_ch(int config, const T* x, const T* wp, const T* bias, T* y, const HeadArgs& a, size_t smem,
                      int max_ctas, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (config) {
#define CONVT3D_HEAD_CASE(IDX, MT_, NTW_, WM_, WN_)                                                  \
  case IDX: {                                                                                       \
    auto kern = head_shuffle_kernel<T, CH, MT_, NTW_, WM_, WN_>;                                    \
    int grid = 0;                                                                                   \
    if (smem > 48 * 1024)                                                                           \
      err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);     \
    if (err == cudaSuccess) err = grid_for(kern, WM_ * WN_ * 32, smem, a.total, max_ctas, &grid);     \
    if (err == cudaSuccess) kern<<<(unsigned)grid, WM_ * WN_ * 32, smem, stream>>>(x, wp, bias, y, a); \
    break;                                                                                          \
  }
    CONVT3D_HEAD_CONFIGS(CONVT3D_HEAD_CASE)
#undef CONVT3D_HEAD_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename T>
cudaError_t launch(int config, const void* x, const void* wp, const void* bias, void* y, const HeadArgs& a,
                   size_t smem, int max_ctas, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x);
  const T* wpp = static_cast<const T*>(wp);
  const T* bp = static_cast<const T*>(bias);
  T* yp = static_cast<T*>(y);
  switch (a.ch) {
    case 2: return launch_ch<T, 2>(config, xp, wpp, bp, yp, a, smem, max_ctas, stream);
    case 4: return launch_ch<T, 4>(config, xp, wpp, bp, yp, a, smem, max_ctas, stream);
    case 8: return launch_ch<T, 8>(config, xp, wpp, bp, yp, a, smem, max_ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

// head.py's pack_weight in one launch: [g][chunk][shift][column][KC], zero-padded, fp32 rounded to TF32.
struct PackArgs {
  int64_t sw[5];  // weight strides (ci, co, kd, kh, kw), elements
  int k[3], st[3], js[3];
  int cin_g, cout_g, np, kc, nchunks, jtot, jn;
  int64_t total;  // elements of the packed weight
};

template <typename T>
__global__ void pack_weight_kernel(const T* __restrict__ w, T* __restrict__ out, const PackArgs p) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.total) return;
  int64_t t = i;
  const int k = (int)(t % p.kc); t /= p.kc;
  const int n = (int)(t % p.np); t /= p.np;
  const int j = (int)(t % p.jtot); t /= p.jtot;
  const int chunk = (int)(t % p.nchunks);
  const int64_t grp = t / p.nchunks;
  const int ci = chunk * p.kc + k;
  const int res = p.st[0] * p.st[1] * p.st[2];
  const int co = n % p.cout_g, rr = n / p.cout_g;
  const int jwn = rr / res, r = rr % res;  // width shift (as a column) and residue
  const int rw = r % p.st[2], rh = (r / p.st[2]) % p.st[1], rd = r / (p.st[2] * p.st[1]);
  const int jw = j % p.js[2] + jwn, jh = (j / p.js[2]) % p.js[1], jd = j / (p.js[2] * p.js[1]);
  const int td = jd * p.st[0] + rd, th = jh * p.st[1] + rh, tw = jw * p.st[2] + rw;
  const bool ok = ci < p.cin_g && jwn < p.jn && td < p.k[0] && th < p.k[1] && tw < p.k[2];
  T v = from_float<T>(0.f);
  if (ok) v = w[(grp * p.cin_g + ci) * p.sw[0] + co * p.sw[1] + td * p.sw[2] + th * p.sw[3] + tw * p.sw[4]];
  if constexpr (std::is_same<T, float>::value) v = __uint_as_float(tf32_round(__float_as_uint(v)));
  out[i] = v;
}

// One library per element type (CONVT3D_HEAD_DTYPE: 0 float32 at TF32, 1 bfloat16, 2 float16).
#ifndef CONVT3D_HEAD_DTYPE
#define CONVT3D_HEAD_DTYPE 1
#endif
#if CONVT3D_HEAD_DTYPE == 0
using Elem = float;
#elif CONVT3D_HEAD_DTYPE == 1
using Elem = __nv_bfloat16;
#else
using Elem = __half;
#endif

}  // namespace

// The ctypes entry point (returns a cudaError_t): meta as head.py's HeadPlan.meta, then the input's and output's
// strides and the staging mode; shifts: per shift its n-tile mask, then its staged-row byte offsets.
extern "C" int convt3d_head_launch(const void* x, const void* wp, const void* bias, void* y, const int64_t* meta,
                                   const int64_t* shifts, int nshifts, int dtype, int itemsize, int config,
                                   void* stream) {
  if (nshifts > MAX_SHIFTS || nshifts < 1) return (int)cudaErrorInvalidValue;
  HeadArgs a;
  for (int i = 0; i < 3; ++i) {
    a.in[i] = (int)meta[i];
    a.out[i] = (int)meta[3 + i];
    a.st[i] = (int)meta[6 + i];
    a.pad[i] = (int)meta[9 + i];
    a.js[i] = (int)meta[12 + i];
    a.q0[i] = (int)meta[15 + i];
    a.bt[i] = (int)meta[18 + i];
    a.tiles[i] = (int)meta[21 + i];
  }
  a.cin_g = (int)meta[24];
  a.cout_g = (int)meta[25];
  a.groups = (int)meta[26];
  a.np = (int)meta[27];
  a.nchunks = (int)meta[28];
  a.kc = (int)meta[29];
  const int64_t total = meta[30];
  const size_t smem = (size_t)meta[31];
  const int bn = (int)meta[32];
  a.stages = (int)meta[33];
  a.wres = (int)meta[34];
  a.stage_bytes = (int)meta[35];
  a.w_off = (int)meta[36];
  a.rtab_off = (int)meta[37];
  a.etab_off = (int)meta[38];
  a.cs_off = (int)meta[39];
  const int max_ctas = (int)meta[40];
  a.jn = (int)meta[41];
  for (int i = 0; i < 5; ++i) {
    a.sx[i] = meta[42 + i];
    a.sy[i] = meta[47 + i];
  }
  a.mode = (int)meta[52];
  a.ch = a.kc * itemsize / 16;
  // meta's box is the M rows' (BD, BH, mw); a tile's output blocks along W are mw - jn + 1
  a.mw = a.bt[2];
  a.bt[2] = a.mw - a.jn + 1;
  for (int i = 0; i < 3; ++i) a.hb[i] = (i == 2 ? a.mw : a.bt[i]) + a.js[i] - 1;
  a.rc = a.st[0] * a.st[1] * a.st[2] * a.cout_g;
  a.jtot = a.js[0] * a.js[1] * a.js[2];
  a.hr = a.hb[0] * a.hb[1] * a.hb[2];
  if (nshifts != a.jtot || (a.ch != 2 && a.ch != 4 && a.ch != 8) || a.mode < 0 || a.mode > 2 ||
      (a.mode == 1 && itemsize != 4) || a.stages < 1 || a.stages > 2 || total > 0x7fffffff ||
      (a.wres && a.groups != 1) || bn < 8 || (bn & (bn - 1)) != 0 || a.jn < 1 || a.bt[2] < 1 ||
      (a.jn > 1 && a.js[2] != 1) || a.jn * a.rc > a.np)
    return (int)cudaErrorInvalidValue;
  a.total = (int)total;
  auto recip = [](int d) { return (uint32_t)((0x100000000ull + (uint64_t)d - 1) / (uint64_t)d); };
  a.m_hb2 = recip(a.hb[2]);
  a.m_hb1 = recip(a.hb[1]);
  a.m_hr = recip(a.hr);
  a.m_mw = recip(a.mw);
  a.m_bt1 = recip(a.bt[1]);
  for (int i = 0; i < 3; ++i) {
    a.m_st[i] = recip(a.st[i]);
    a.m_len[i] = recip(a.bt[i] * a.st[i]);
  }
  a.m_cout = recip(a.cout_g);
  for (int j = 0; j < MAX_SHIFTS; ++j) {
    a.ntmask[j] = j < a.jtot ? (unsigned)shifts[j] : 0u;
    a.shoff[j] = j < a.jtot ? (int)shifts[a.jtot + j] : 0;
  }
  if (total == 0) return (int)cudaSuccess;
  if (dtype != CONVT3D_HEAD_DTYPE || itemsize != (int)sizeof(Elem)) return (int)cudaErrorInvalidValue;
  return (int)launch<Elem>(config, x, wp, bias, y, a, smem, max_ctas, static_cast<cudaStream_t>(stream));
}

// Packs a weight (pack_weight_kernel); meta as head.py's pack_weight_cuda lays it out.
extern "C" int convt3d_head_pack(const void* w, void* out, const int64_t* meta, int dtype, int itemsize,
                                 void* stream) {
  if (dtype != CONVT3D_HEAD_DTYPE || itemsize != (int)sizeof(Elem)) return (int)cudaErrorInvalidValue;
  PackArgs p;
  for (int i = 0; i < 3; ++i) {
    p.k[i] = (int)meta[i];
    p.st[i] = (int)meta[3 + i];
    p.js[i] = (int)meta[6 + i];
  }
  p.cin_g = (int)meta[9];
  p.cout_g = (int)meta[10];
  p.np = (int)meta[11];
  p.kc = (int)meta[12];
  p.nchunks = (int)meta[13];
  const int64_t groups = meta[14];
  for (int i = 0; i < 5; ++i) p.sw[i] = meta[15 + i];
  p.jn = (int)meta[20];
  p.jtot = p.js[0] * p.js[1] * p.js[2];
  p.total = groups * p.nchunks * p.jtot * (int64_t)p.np * p.kc;
  if (p.total == 0) return (int)cudaSuccess;
  const int threads = 256;
  pack_weight_kernel<Elem><<<(unsigned)((p.total + threads - 1) / threads), threads, 0,
                             static_cast<cudaStream_t>(stream)>>>(static_cast<const Elem*>(w), static_cast<Elem*>(out), p);
  return (int)cudaGetLastError();
}
