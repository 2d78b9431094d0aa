// convt3d's CUDA head kernel: output heads (few output channels per group) at dilation 1, one
// launch, the input read once from HBM and once per shift from shared memory.
//
// Geometry (the "shuffle" view of head_engine.shuffle_layer; the launcher, convt3d/cuda_head.py,
// computes every size below). Along each dimension a tap t = j * s + r (shift j < J = ceil(k/s),
// residue r < s) sends input i to output (i + j) * s - p + r. So the outputs o = q * s - p + r of
// block q are the sums, over the shifts j and the input channels, of X[q - j] times the weight of
// tap j * s + r:
//
//   Y[block q][(r, co)] = bias[co] + sum_{j, ci} X[q - j][ci] * Wj[ci][(r, co)]
//
// a GEMM with M = output blocks, N = residues x Cout/g (the "columns", padded to 8) and
// K = shifts x Cin/g, whose A operand for shift j is the input tile moved by j positions.
//
// Why CUDA C++ here: each CTA owns a box of BD x BH x BW output blocks. Per chunk of KC input
// channels it stages the input box those blocks read -- the box plus a halo of J - 1 positions
// per dimension -- in shared memory once, and every shift reads its A fragments from that one
// tile with ldmatrix at a run-time row offset (each lane names its own row, so a window of a 3-D
// box is as cheap as a contiguous one). Triton cannot slice shared memory at such offsets and
// Gluon only at multiples of the slice length (NOTES section 10), so its shuffle kind loads the
// input tile once per shift through L1 (ncu: L1/TEX 81-87%, the limiter).
//
// Layout of the staged tiles: a row of RB = KC x sizeof(T) bytes (32, 64 or 128) per position,
// 16-byte units XOR-swizzled by (row >> SH) & (CH - 1) (Rows<CH>), so the 8 rows an ldmatrix phase
// reads -- any 8 consecutive rows, whatever the shift -- hit 8 different 16-byte bank groups.
// The weights of the chunk (every shift, every column) sit beside the input as rows of the same
// shape, B's rows being columns n (k contiguous), which is ldmatrix's non-transposed B layout.
//
// The MMAs: bf16 / fp16 m16n8k16 and tf32 m16n8k8, fp32 accumulation. A 32-byte slice of a row
// is one K step for both (16 half-words or 8 tf32 words), so fragments load alike: A with
// ldmatrix.x4 (rows 0-7 / 8-15, low / high 16 bytes), B with ldmatrix.x4 for two n-tiles. fp32
// operands are rounded to TF32 as cuDNN rounds them (cvt.rna: nearest, ties away from zero)
// when they are staged. A shift whose taps miss every column of a warp's n-tiles (k3 s2: tap 3
// does not exist) is skipped by a per-shift bit mask of the n-tiles it feeds.
//
// Epilogue: the accumulators go through shared memory (the tile region, reused) so that each
// output row is written by consecutive lanes: along W for NCDHW, along (W, C) for channels-last;
// bias added, converted to T, masked to the output (blocks past the output and cropped padding).
// Offsets into the tensors are 64-bit; any input strides are read (channels-last 16-byte vector
// loads where channels are contiguous and aligned).
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
  int js[3];              // shifts per dimension
  int q0[3];              // first block of the output: pad / stride
  int bt[3];              // blocks per CTA tile (BD, BH, BW)
  int tiles[3];           // tiles per dimension
  int hb[3];              // staged input box: bt + js - 1
  int cin_g, cout_g, groups;
  int np;                 // columns, residues x cout_g rounded up to 8
  int nchunks, kc, ch;    // channel chunks, channels per chunk, 16-byte units per row
  int jtot, hr;           // shifts, staged input rows (hb product)
  int mode;               // input staging: 0 cp.async 16 B units, 1 cp.async 4 B elements, 2 registers
  int stages;             // 1, or 2 (chunk c + 1 staged while chunk c is multiplied)
  int stage_bytes;        // one stage: input rows and weight rows
  // multiply-high reciprocals ceil(2^32 / d) of the run-time divisors: exact while n x d < 2^32,
  // and here n < 2^17 (staged elements of a chunk, outputs of a tile) and d < 2^13
  uint32_t m_hb2, m_hb1, m_hr, m_bt2, m_bt1, m_st[3], m_len[3], m_cout;
  unsigned ntmask[MAX_SHIFTS];    // per shift: the n-tiles any of its taps feeds
};

// m = 0 stands for d = 1 (ceil(2^32 / 1) does not fit 32 bits)
__device__ __forceinline__ int fdiv(int n, uint32_t m) { return m ? (int)__umulhi((uint32_t)n, m) : n; }

template <typename T> struct Raw { using type = uint16_t; };
template <> struct Raw<float> { using type = uint32_t; };

__device__ __forceinline__ uint32_t tf32_bits(uint32_t bits) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(bits)));
  return r;
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// cp.async with zero fill: src_bytes 0 writes zeros and reads nothing (the address is then any
// valid one).
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

// Staged rows of CH 16-byte units (RB bytes). Unit c of row r sits at c ^ key(r), the key
// (r >> SH) & (CH - 1) repeating every 8 rows, so any 8 consecutive rows of an ldmatrix phase
// hit 8 different 16-byte bank groups.
template <int CH>
struct Rows {
  static constexpr int RB = CH * 16;
  static constexpr int SH = CH == 8 ? 0 : (CH == 4 ? 1 : 2);
  static constexpr int LOG = CH == 8 ? 3 : (CH == 4 ? 2 : 1);  // log2(CH)
  // the key of row r as a byte offset (XORed into a unit's byte offset)
  static __device__ __forceinline__ int key(int r) { return ((r >> SH) & (CH - 1)) << 4; }
  // byte offset of unit c of row r
  static __device__ __forceinline__ int at(int r, int c) { return r * RB + ((c << 4) ^ key(r)); }
};

// Where staged row `row` of the CTA's box reads the input: its element offset inside the batch
// element and group, or -1 outside the input.
__device__ __forceinline__ int64_t box_offset(const HeadArgs& a, int row, int i0d, int i0h, int i0w) {
  const int t = fdiv(row, a.m_hb2);
  const int hw = row - t * a.hb[2];
  const int hd = fdiv(t, a.m_hb1);
  const int hh = t - hd * a.hb[1];
  const int id = i0d + hd, ih = i0h + hh, iw = i0w + hw;
  if ((unsigned)id >= (unsigned)a.in[0] || (unsigned)ih >= (unsigned)a.in[1] || (unsigned)iw >= (unsigned)a.in[2])
    return -1;
  return (int64_t)id * a.sx[2] + (int64_t)ih * a.sx[3] + (int64_t)iw * a.sx[4];
}

// Stage input channel chunk `chunk` of the CTA's input box and the chunk's weights into one
// stage (As, Bs). rtab holds each staged row's input offset (-1 outside the input), computed once
// per CTA. Past Cin/g: zeros. Modes (the launcher picks):
//   0: channels contiguous and 16-byte aligned: one cp.async of 16 bytes per unit; a thread keeps
//      one unit column (blockDim is a multiple of CH) and walks rows;
//   1: fp32, any strides: one cp.async of 4 bytes per element, lanes along rows (NCDHW rows are
//      read by consecutive lanes);
//   2: 16-bit, any strides: element loads into registers, 4 units (32 loads) in flight per thread,
//      then 16-byte stores.
// The weights always arrive by 16-byte cp.async. The caller commits and waits.
template <typename T, int CH, int BN>
__device__ __forceinline__ void stage_chunk(const T* __restrict__ x, const T* __restrict__ wp, char* As, char* Bs,
                                            const int64_t* rtab, const HeadArgs& a, int64_t xbase, int grp,
                                            int chunk) {
  using R = typename Raw<T>::type;
  using Row = Rows<CH>;
  constexpr int V = 16 / sizeof(T);
  constexpr int LOGCH = Row::LOG;
  const uint32_t as = static_cast<uint32_t>(__cvta_generic_to_shared(As));
  const int cbase = chunk * a.kc;
  const int c = threadIdx.x & (CH - 1);  // this thread's unit column (modes 0 and the weights)
  if (a.mode == 0) {
    const int ci0 = cbase + c * V;
    const bool cok = ci0 < a.cin_g;
    const T* xc = x + xbase + ci0;
    for (int row = threadIdx.x >> LOGCH; row < a.hr; row += blockDim.x >> LOGCH) {
      const int64_t off = rtab[row];
      const bool ok = cok && off >= 0;
      cp_async16(as + Row::at(row, c), ok ? xc + off : x, ok ? 16 : 0);
    }
  } else if (a.mode == 1) {
    const int elems = a.hr * CH * V;
    for (int u = threadIdx.x; u < elems; u += blockDim.x) {
      const int ce = fdiv(u, a.m_hr);  // channel within the chunk
      const int row = u - ce * a.hr;
      const int uc = ce / V, e = ce - uc * V;
      const int ci = cbase + ce;
      const int64_t off = rtab[row];
      const bool ok = off >= 0 && ci < a.cin_g;
      const T* p = ok ? x + xbase + off + (int64_t)ci * a.sx[1] : x;
      cp_async4(as + Row::at(row, uc) + e * 4, p, ok ? 4 : 0);
    }
  } else {
    const R* xr = reinterpret_cast<const R*>(x);
    const int units = a.hr * CH;
    for (int u0 = threadIdx.x; u0 < units; u0 += 4 * blockDim.x) {
      uint32_t w[4][4];
      int dst[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int u = u0 + q * blockDim.x;
        const int uc = fdiv(u, a.m_hr);
        const int row = u - uc * a.hr;
        const int ci0 = cbase + uc * V;
        const int64_t off = u < units ? rtab[row] : -1;
        dst[q] = u < units ? Row::at(row, uc) : -1;
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
        if (dst[q] >= 0) *reinterpret_cast<uint4*>(As + dst[q]) = make_uint4(w[q][0], w[q][1], w[q][2], w[q][3]);
    }
  }
  // Weights: global [jtot][np][kc] of this (group, chunk), staged as rows j * BN + n (rows past
  // np zero, so a pair of n-tiles never reads stale rows).
  const T* wc = wp + ((int64_t)grp * a.nchunks + chunk) * (int64_t)a.jtot * a.np * a.kc + c * V;
  const uint32_t bs = static_cast<uint32_t>(__cvta_generic_to_shared(Bs));
  const int wrows = a.jtot * BN;
  for (int row = threadIdx.x >> LOGCH; row < wrows; row += blockDim.x >> LOGCH) {
    const int j = row / BN;
    const int n = row - j * BN;
    const bool ok = n < a.np;
    cp_async16(bs + Row::at(row, c), ok ? wc + (int64_t)(j * a.np + n) * a.kc : wp, ok ? 16 : 0);
  }
}

// One CTA: a BD x BH x BW box of output blocks (BM = WM x MT x 16 of them) of one (batch
// element, group), all BN = WN x NTW x 8 columns. Warps split M (WM) and N (WN); a warp holds
// MT m-tiles x NTW n-tiles of accumulators and reuses each B fragment for its MT m-tiles. CH,
// the 16-byte units of a staged row, is a template parameter so that the K steps of a chunk
// unroll and each ldmatrix address is one XOR and one add from per-shift values.
template <typename T, int CH, int MT, int NTW, int WM, int WN>
__global__ void __launch_bounds__(WM * WN * 32)
head_shuffle_kernel(const T* __restrict__ x, const T* __restrict__ wp, const T* __restrict__ bias,
                    T* __restrict__ y, const HeadArgs a) {
  constexpr bool F32 = std::is_same<T, float>::value;
  constexpr int BM = WM * MT * 16;
  constexpr int BN = WN * NTW * 8;
  constexpr int CP = BN + 4;  // fp32 pitch of the epilogue's staging rows
  using Row = Rows<CH>;
  constexpr int RB = Row::RB;
  extern __shared__ __align__(128) char smem[];

  // Tile of this CTA: width tiles fastest, then height, depth, group, batch element.
  int64_t t = blockIdx.x;
  const int tw = (int)(t % a.tiles[2]); t /= a.tiles[2];
  const int th = (int)(t % a.tiles[1]); t /= a.tiles[1];
  const int td = (int)(t % a.tiles[0]); t /= a.tiles[0];
  const int grp = (int)(t % a.groups);
  const int64_t nb = t / a.groups;
  const int qd0 = a.q0[0] + td * a.bt[0], qh0 = a.q0[1] + th * a.bt[1], qw0 = a.q0[2] + tw * a.bt[2];
  // the staged box starts J - 1 inputs before the tile's first block (block q reads q - j)
  const int i0d = qd0 - (a.js[0] - 1), i0h = qh0 - (a.js[1] - 1), i0w = qw0 - (a.js[2] - 1);
  const int64_t xbase = nb * a.sx[0] + (int64_t)grp * a.cin_g * a.sx[1];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wm = warp % WM;
  const int wn = warp / WM;
  const int nt0 = wn * NTW;

  // Staged row of the block each lane addresses for ldmatrix, per m-tile, at shift 0.
  int rowbase[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m = (wm * MT + mt) * 16 + (lane & 15);
    const int r = fdiv(m, a.m_bt2);
    const int lw = m - r * a.bt[2];
    const int ld = fdiv(r, a.m_bt1);
    const int lh = r - ld * a.bt[1];
    rowbase[mt] = ((ld + a.js[0] - 1) * a.hb[1] + lh + a.js[1] - 1) * a.hb[2] + lw + a.js[2] - 1;
  }
  // Per-lane halves of a K step: A lanes 16-31 read the high 16 bytes; B lanes 8-15 and 24-31.
  const int a_hi = (lane >> 4) << 4;
  const int b_hi = ((lane >> 3) & 1) << 4;
  // B's rows j * BN + 8 x tile + (lane & 7) (+ 8 for lanes 16-31) keep one swizzle key per lane:
  // the key (row >> SH) & (CH - 1) repeats every 8 rows for every CH.
  const int b_lane_row = (lane & 7) + ((lane >> 4) << 3);
  const int b_hk = b_hi ^ Row::key(b_lane_row);

  float acc[MT][NTW][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NTW; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.f;

  const unsigned warp_bits = (1u << NTW) - 1u;
  const int a_bytes = a.hr * RB;

  // Input offset of every staged row (-1 outside the input), once per CTA, after the stages.
  int64_t* rtab = reinterpret_cast<int64_t*>(smem + a.stages * a.stage_bytes);
  for (int r = threadIdx.x; r < a.hr; r += blockDim.x) rtab[r] = box_offset(a, r, i0d, i0h, i0w);
  __syncthreads();

  stage_chunk<T, CH, BN>(x, wp, smem, smem + a_bytes, rtab, a, xbase, grp, 0);
  cp_async_commit();
  for (int chunk = 0; chunk < a.nchunks; ++chunk) {
    const int buf = a.stages == 2 ? (chunk & 1) : 0;
    if (a.stages == 2 && chunk + 1 < a.nchunks) {
      char* nxt = smem + ((chunk + 1) & 1) * a.stage_bytes;
      stage_chunk<T, CH, BN>(x, wp, nxt, nxt + a_bytes, rtab, a, xbase, grp, chunk + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t as_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem + buf * a.stage_bytes));
    const uint32_t bs_base = as_base + a_bytes + (uint32_t)((nt0 * 8 + b_lane_row) * RB);
    int j = 0;
    for (int jd = 0; jd < a.js[0]; ++jd) {
      for (int jh = 0; jh < a.js[1]; ++jh) {
        for (int jw = 0; jw < a.js[2]; ++jw, ++j) {
          const unsigned bits = (a.ntmask[j] >> nt0) & warp_bits;
          if (bits == 0u) continue;  // no tap of this shift feeds this warp's columns
          const int shift = (jd * a.hb[1] + jh) * a.hb[2] + jw;
          uint32_t arow[MT];
          int ahk[MT];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int r = rowbase[mt] - shift;
            arow[mt] = as_base + (uint32_t)(r * RB);
            ahk[mt] = a_hi ^ Row::key(r);
          }
          const uint32_t brow = bs_base + (uint32_t)(j * BN * RB);
#pragma unroll
          for (int ks = 0; ks < CH / 2; ++ks) {
            uint32_t b[NTW][2];
#pragma unroll
            for (int i = 0; i + 1 < NTW; i += 2) {
              uint32_t r[4];
              ldsm_x4(r, brow + i * 8 * RB + ((32 * ks) ^ b_hk));
              b[i][0] = r[0]; b[i][1] = r[1]; b[i + 1][0] = r[2]; b[i + 1][1] = r[3];
            }
            if constexpr (NTW % 2 == 1) {
              uint32_t r[2];
              ldsm_x2(r, brow + (NTW - 1) * 8 * RB + ((32 * ks) ^ b_hk));
              b[NTW - 1][0] = r[0]; b[NTW - 1][1] = r[1];
            }
            if constexpr (F32) {  // TF32 operands rounded as cuDNN rounds them (cvt.rna)
#pragma unroll
              for (int i = 0; i < NTW; ++i) { b[i][0] = tf32_bits(b[i][0]); b[i][1] = tf32_bits(b[i][1]); }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              uint32_t af[4];
              ldsm_x4(af, arow[mt] + ((32 * ks) ^ ahk[mt]));
              if constexpr (F32) {
#pragma unroll
                for (int k = 0; k < 4; ++k) af[k] = tf32_bits(af[k]);
              }
#pragma unroll
              for (int i = 0; i < NTW; ++i)
                if ((bits >> i) & 1u) mma<T>(acc[mt][i], af, b[i]);
            }
          }
        }
      }
    }
    __syncthreads();  // this stage is read; the next staging may overwrite it
    if (a.stages == 1 && chunk + 1 < a.nchunks) {
      stage_chunk<T, CH, BN>(x, wp, smem, smem + a_bytes, rtab, a, xbase, grp, chunk + 1);
      cp_async_commit();
    }
  }

  // Epilogue: accumulators to shared memory, then whole output rows per lane group.
  float* Cs = reinterpret_cast<float*>(smem);
  const int g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m = (wm * MT + mt) * 16 + g8;
#pragma unroll
    for (int i = 0; i < NTW; ++i) {
      const int n = (nt0 + i) * 8 + 2 * t4;
      *reinterpret_cast<float2*>(Cs + m * CP + n) = make_float2(acc[mt][i][0], acc[mt][i][1]);
      *reinterpret_cast<float2*>(Cs + (m + 8) * CP + n) = make_float2(acc[mt][i][2], acc[mt][i][3]);
    }
  }
  __syncthreads();

  // Each thread keeps fixed output columns of the tile's rows and walks the rows: columns are the
  // width outputs (NCDHW; rows are (channel, depth, height)) or (width, channel) pairs
  // (channels-last; rows are (depth, height)), so consecutive lanes write consecutive addresses
  // and the column's share of the indices is computed once.
  const int sd = a.st[0], sh = a.st[1], sw = a.st[2];
  const int ld_len = a.bt[0] * sd, lh_len = a.bt[1] * sh, lw_len = a.bt[2] * sw;
  const int od0 = qd0 * sd - a.pad[0], oh0 = qh0 * sh - a.pad[1], ow0 = qw0 * sw - a.pad[2];
  const int cout_g = a.cout_g;
  const bool cl_out = a.sy[1] == 1 && a.sy[4] != 1;
  const int cols = cl_out ? lw_len * cout_g : lw_len;
  const int rows = cl_out ? ld_len * lh_len : cout_g * ld_len * lh_len;
  const int per_row = cols < (int)blockDim.x ? cols : (int)blockDim.x;
  const int row_step = blockDim.x / per_row;
  const int64_t ybase = nb * a.sy[0] + (int64_t)grp * cout_g * a.sy[1];
  const int r0 = threadIdx.x / per_row;
  if (r0 < row_step) {
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
      const int cs_col = lw * CP + rw * cout_g + co_c;
      const int64_t y_col = (int64_t)ow * a.sy[4] + (int64_t)co_c * a.sy[1];
      for (int r = r0; r < rows; r += row_step) {
        const int t = fdiv(r, a.m_len[1]);
        const int ohl = r - t * lh_len;
        const int co_r = fdiv(t, a.m_len[0]);
        const int odl = t - co_r * ld_len;
        const int od = od0 + odl, oh = oh0 + ohl;
        if ((unsigned)od >= (unsigned)a.out[0] || (unsigned)oh >= (unsigned)a.out[1]) continue;
        const int lh = fdiv(ohl, a.m_st[1]), rh = ohl - lh * sh;
        const int ldd = fdiv(odl, a.m_st[0]), rd = odl - ldd * sd;
        const int co = co_r + co_c;
        float v = Cs[(ldd * a.bt[1] + lh) * a.bt[2] * CP + (rd * sh + rh) * sw * cout_g + co_r + cs_col];
        if (bias != nullptr) v += to_float<T>(bias[grp * cout_g + co]);
        y[ybase + y_col + (int64_t)co_r * a.sy[1] + (int64_t)od * a.sy[2] + (int64_t)oh * a.sy[3]] = from_float<T>(v);
      }
    }
  }
}

// Tile configurations: index -> (MT, NTW, WM, WN), BM = WM x MT x 16 output blocks and
// BN = WN x NTW x 8 columns per CTA. The launcher (cuda_head.CONFIGS) keeps the same table.
#define CONVT3D_HEAD_CONFIGS(X) \
  X(0, 4, 1, 4, 1)  /* BM 256, BN 8 */ \
  X(1, 4, 2, 4, 1)  /* BM 256, BN 16 */ \
  X(2, 2, 4, 4, 1)  /* BM 128, BN 32 */ \
  X(3, 2, 4, 4, 2)  /* BM 128, BN 64 */ \
  X(4, 2, 4, 2, 4)  /* BM 64, BN 128 */ \
  X(5, 2, 1, 4, 1)  /* BM 128, BN 8 */ \
  X(6, 2, 2, 4, 1)  /* BM 128, BN 16 */

template <typename T, int CH>
cudaError_t launch_ch(int config, const T* x, const T* wp, const T* bias, T* y, const HeadArgs& a, int64_t blocks,
                      size_t smem, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (config) {
#define CONVT3D_HEAD_CASE(IDX, MT_, NTW_, WM_, WN_)                                                  \
  case IDX: {                                                                                       \
    auto kern = head_shuffle_kernel<T, CH, MT_, NTW_, WM_, WN_>;                                    \
    if (smem > 48 * 1024)                                                                           \
      err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);     \
    if (err == cudaSuccess) kern<<<(unsigned)blocks, WM_ * WN_ * 32, smem, stream>>>(x, wp, bias, y, a); \
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
                   int64_t blocks, size_t smem, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x);
  const T* wpp = static_cast<const T*>(wp);
  const T* bp = static_cast<const T*>(bias);
  T* yp = static_cast<T*>(y);
  switch (a.ch) {
    case 2: return launch_ch<T, 2>(config, xp, wpp, bp, yp, a, blocks, smem, stream);
    case 4: return launch_ch<T, 4>(config, xp, wpp, bp, yp, a, blocks, smem, stream);
    case 8: return launch_ch<T, 8>(config, xp, wpp, bp, yp, a, blocks, smem, stream);
    default: return cudaErrorInvalidValue;
  }
}

// One library per element type (CONVT3D_HEAD_DTYPE: 0 float32 at TF32, 1 bfloat16, 2 float16),
// built when a call of that type first needs it: 21 kernels each.
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

// The library's one entry point, called through ctypes (convt3d/cuda_head.py): no Python or
// torch headers, so the build is nvcc alone. meta (int64): in[3], out[3], stride[3], pad[3],
// shifts[3], q0[3], box[3], tiles[3], cin_g, cout_g, groups, columns, chunks, KC, CTAs, shared
// memory bytes, BN, then the input's and the output's strides (n, c, d, h, w), the staging mode
// and the stages. masks: one n-tile mask per shift. dtype: 0 float32 (TF32), 1 bfloat16, 2 float16, this library's
// (CONVT3D_HEAD_DTYPE). Returns a cudaError_t.
extern "C" int convt3d_head_launch(const void* x, const void* wp, const void* bias, void* y, const int64_t* meta,
                                   const int64_t* masks, int nmasks, int dtype, int itemsize, int config,
                                   void* stream) {
  if (nmasks > MAX_SHIFTS) return (int)cudaErrorInvalidValue;
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
    a.hb[i] = a.bt[i] + a.js[i] - 1;
  }
  a.cin_g = (int)meta[24];
  a.cout_g = (int)meta[25];
  a.groups = (int)meta[26];
  a.np = (int)meta[27];
  a.nchunks = (int)meta[28];
  a.kc = (int)meta[29];
  const int64_t blocks = meta[30];
  const size_t smem = (size_t)meta[31];
  for (int i = 0; i < 5; ++i) {
    a.sx[i] = meta[33 + i];
    a.sy[i] = meta[38 + i];
  }
  a.mode = (int)meta[43];
  a.stages = (int)meta[44];
  a.ch = a.kc * itemsize / 16;
  a.jtot = a.js[0] * a.js[1] * a.js[2];
  a.hr = a.hb[0] * a.hb[1] * a.hb[2];
  if (nmasks != a.jtot || (a.ch != 2 && a.ch != 4 && a.ch != 8) || a.mode < 0 || a.mode > 2 ||
      (a.mode == 1 && itemsize != 4) || a.stages < 1 || a.stages > 2)
    return (int)cudaErrorInvalidValue;
  const int bn = (int)meta[32];
  a.stage_bytes = a.hr * a.ch * 16 + a.jtot * bn * a.ch * 16;
  auto recip = [](int d) { return (uint32_t)((0x100000000ull + (uint64_t)d - 1) / (uint64_t)d); };
  a.m_hb2 = recip(a.hb[2]);
  a.m_hb1 = recip(a.hb[1]);
  a.m_hr = recip(a.hr);
  a.m_bt2 = recip(a.bt[2]);
  a.m_bt1 = recip(a.bt[1]);
  for (int i = 0; i < 3; ++i) {
    a.m_st[i] = recip(a.st[i]);
    a.m_len[i] = recip(a.bt[i] * a.st[i]);
  }
  a.m_cout = recip(a.cout_g);
  for (int j = 0; j < MAX_SHIFTS; ++j) a.ntmask[j] = j < a.jtot ? (unsigned)masks[j] : 0u;
  if (blocks == 0) return (int)cudaSuccess;
  if (dtype != CONVT3D_HEAD_DTYPE || itemsize != (int)sizeof(Elem)) return (int)cudaErrorInvalidValue;
  return (int)launch<Elem>(config, x, wp, bias, y, a, blocks, smem, static_cast<cudaStream_t>(stream));
}
