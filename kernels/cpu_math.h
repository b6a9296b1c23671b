/* Math shared by the C kernels, written so that GCC vectorizes the loops that call it. */

#ifndef SYMPHONY_CPU_MATH_H
#define SYMPHONY_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* e^x to about one ulp where it is a normal float; exactly 0 below that (softmax relies on
 * exp(-inf) == 0 for the keys it masks) and infinity above 88. libm's expf is one call per
 * element, which the compiler will not vectorize without -ffast-math. (Cephes' expf.) */
static inline float exp_f32(float x)
{
    const float lo = -87.3f, hi = 88.0f;
    float clamped = x < lo ? lo : x;
    clamped = clamped > hi ? hi : clamped;
    float n = __builtin_floorf(clamped * 1.44269504088896341f + 0.5f);
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x < lo ? 0.0f : y;
    return x > hi ? __builtin_inff() : y;
}

#endif
