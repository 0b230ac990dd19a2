// The C entry point of the CPU execution harness. test_metal.py writes kernels.inc (the
// variants under test, each one's source (lik.runtime.metal's preamble, the shared
// metal/common.metal, then its kernel's generated file) in a namespace of its own, and
// LIK_KERNELS, a table of their kernels named "<variant>/<kernel>"), builds this file
// into a shared library and calls lik_cpu_launch through ctypes with the same arguments,
// in the same order, that Metal would receive.
// (kernel, device, constant and thread are macros here, as in metal_cpu.h: no identifier
// may use them.)
#include "metal_cpu.h"

#include "kernels.inc"

extern "C" int lik_cpu_launch(const char* name, void* const* args, long threads,
                              long group_size, char* error, long error_len) {
  for (const lik_cpu::KernelEntry& entry : LIK_KERNELS) {
    if (std::strcmp(entry.name, name) == 0) {
      const std::string message = entry.launch(args, threads, group_size);
      std::snprintf(error, size_t(error_len), "%s", message.c_str());
      return message.empty() ? 0 : 1;
    }
  }
  std::snprintf(error, size_t(error_len), "no kernel named %s in this build", name);
  return 1;
}
