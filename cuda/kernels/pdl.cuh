// Programmatic dependent launch (PDL, sm_90+; both helpers are no-ops on older
// devices and in kernels launched plainly).
//
// Who may be a programmatic dependent here, and what that allows: the V2
// reduce (of the attention kernel just before it) and the grouped attention
// kernel (of whatever kernel precedes it on the stream). Each reads before
// GridDependencyWait() only inputs that no kernel of this library writes
// (seq_lens, block_tables), or issues L2 prefetches, which change no data.
// So any kernel of this library may call AllowDependentLaunch() early.
#pragma once

// Waits until the previous kernel on the stream has completed and its writes
// are visible (returns at once when this kernel was launched plainly).
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream, if launched as a programmatic
// dependent, be scheduled once every CTA of this grid has called this (or
// exited); it still waits for this grid to complete before reading its
// results.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
