// The Metal Shading Language surface that templates/metal/ uses, declared for a C++17
// compiler, so that every declared Metal variant (lik.runtime.metal's preamble, then the
// shared generated metal/common.metal, then its kernel's generated .metal file) can be
// syntax- and type-checked without a Mac (g++ -fsyntax-only, see tests/test_metal.py).
// Only what the templates use is here: a kernel that reaches for anything else fails the
// check. metal_cpu.h adds the definitions that run the kernels on the CPU.
//
// What the check cannot see, and how the tests cover it:
//  - address spaces (device, constant, thread) vanish here, so a pointer passed across
//    address spaces is not caught; the kernels only pass device pointers to helpers
//    declared with the same space;
//  - attributes ([[buffer(i)]], [[thread_index_in_simdgroup]], ...) are ignored by the
//    compiler (-Wno-attributes); test_metal.py checks their names and buffer numbering;
//  - there is no threadgroup memory: the kernels talk through simdgroup functions only,
//    and a template that declares threadgroup memory fails to compile here.
#pragma once
#define LIK_METAL_SURFACE 1

#include <cmath>

#define kernel
#define device
#define thread
#define constant const

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef _Float16 half;

namespace metal {

// vec<T, 2> is what simdgroup_matrix::thread_elements() hands out.
template <typename T, int N>
struct vec {
  T v[N];
  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }
};

// One lane's share of an 8x8 matrix spread over the 32 lanes of a simdgroup: two elements
// (which ones is the register layout described in metal_cpu.h).
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  vec<T, 2> elements;
  vec<T, 2>& thread_elements() { return elements; }
  const vec<T, 2>& thread_elements() const { return elements; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value);

// d = a * b + c, a simdgroup-wide operation.
void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                   const simdgroup_float8x8& b, const simdgroup_float8x8& c);

// Simdgroup functions: every lane of the simdgroup calls them together.
float simd_sum(float x);
float simd_shuffle_xor(float x, ushort mask);
int simd_shuffle_xor(int x, ushort mask);
uint simd_shuffle(uint x, ushort lane);
bool simd_any(bool x);

template <typename To, typename From>
To as_type(From x);

float max(float a, float b);
using std::exp;
using std::isnan;
using std::log;
using std::sqrt;

}  // namespace metal
