#!/usr/bin/env python3
"""Patch an unpacked BytePS 0.2.5.post15 sdist so it builds against current PyTorch and CUDA.

    python3 scripts/patch_byteps.py SRC_DIR CXX_STD        (CXX_STD: 17 or 20, what torch's headers need)

Every patch is an exact text replacement in one file; a pattern that is not found stops the script
(another BytePS version needs its patches re-checked, not applied blindly). Each patch says why it is
needed; docs/BYTEPS.md lists them. Applied by scripts/setup_byteps.sh at install time: BytePS's own
files are never committed here.
"""
import os
import sys

SRC, CXX_STD = sys.argv[1], sys.argv[2]
assert CXX_STD in ("17", "20"), CXX_STD
STD = f"-std=c++{CXX_STD}"

# Put after setup.py's imports: distutils' CCompiler.compile, with its per-object loop run on a thread pool
# (each object is one compiler process, so threads suffice). Same arguments; the same objects, returned
# in the same order (compiled in any order: they are independent).
PARALLEL_COMPILE = '''

def _lhc_parallel_compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                          extra_preargs=None, extra_postargs=None, depends=None):
    from multiprocessing.pool import ThreadPool
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
    todo = [obj for obj in objects if obj in build]

    def one(obj):
        src, ext = build[obj]
        self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

    with ThreadPool(max(1, int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1))) as pool:
        list(pool.imap_unordered(one, todo))
    return objects


import distutils.ccompiler  # noqa: E402  (setuptools' copy on Python >= 3.12)
if all(hasattr(distutils.ccompiler.CCompiler, m) for m in ("_setup_compile", "_get_cc_args", "_compile")):
    distutils.ccompiler.CCompiler.compile = _lhc_parallel_compile
'''

PATCHES = [
    # (file, old, new, why)
    ("setup.py", "default_flags = ['-std=c++11',", f"default_flags = ['{STD}',",
     "torch >= 2.1 headers need C++17 (torch 2.14's ATen.h: C++20); the server and core are built with the same flags"),
    ("setup.py", '["-std=c++14" if flag == "-std=c++11"', f'["{STD}" if flag == "-std=c++11"',
     "the torch extension's own C++ standard (was c++14)"),
    ("setup.py", "include_dirs=include_dirs + include_paths(cuda=True)",
     "include_dirs=include_dirs + include_paths('cuda')",
     "torch.utils.cpp_extension.include_paths lost its cuda= keyword (now device_type; positional works for both)"),
    ("setup.py", "            #include <THC/THC.h>\n            void test() {",
     "            #include <c10/cuda/CUDAStream.h>\n            void test() {",
     "the CUDA probe included THC, removed in torch 1.11: probe a c10/cuda header instead"),
    ("setup.py", "updated_macros, 'TORCH_VERSION', str(torch_version))",
     "updated_macros, 'BYTEPS_TORCH_VERSION', str(torch_version))",
     "torch defines TORCH_VERSION itself (a string, torch/version.h): BytePS's numeric macro gets its own name"),
    ("byteps/torch/ops.cc", "#if TORCH_VERSION >= 1005000000", "#if BYTEPS_TORCH_VERSION >= 1005000000",
     "the renamed version macro"),
    ("byteps/torch/ops.cc", "isIntegralType(output.scalar_type())",
     "isIntegralType(output.scalar_type(), /*includeBool=*/true)",
     "c10::isIntegralType(ScalarType) without includeBool was removed"),
    ("byteps/torch/adapter.cc", "#if TORCH_VERSION >= 1001000000", "#if BYTEPS_TORCH_VERSION >= 1001000000",
     "the renamed version macro"),
    ("byteps/torch/ready_event.cc", "#if TORCH_VERSION >= 1005000000", "#if BYTEPS_TORCH_VERSION >= 1005000000",
     "the renamed version macro (every occurrence)"),
    ("byteps/torch/ready_event.cc", "#if TORCH_VERSION < 1005000000", "#if BYTEPS_TORCH_VERSION < 1005000000",
     "the renamed version macro"),
    ("byteps/torch/ops.h", "#include <TH/TH.h>\n\n#if HAVE_CUDA\n#include <THC/THC.h>\n#endif\n",
     "#include <memory>\n#include <mutex>\n",
     "TH/THC headers were removed in torch 1.11 (nothing but the declarations below used them)"),
    ("byteps/torch/ops.h", """#define PUSHPULL_H(torch_Tensor, THTensor)                         \\
  extern "C" int byteps_torch_push_pull_async_##torch_Tensor(      \\
      THTensor* tensor, THTensor* output, int average, char* name, \\
      int version, int priority);

PUSHPULL_H(torch_ByteTensor, THByteTensor)
PUSHPULL_H(torch_IntTensor, THIntTensor)
PUSHPULL_H(torch_LongTensor, THLongTensor)
PUSHPULL_H(torch_FloatTensor, THFloatTensor)
PUSHPULL_H(torch_DoubleTensor, THDoubleTensor)

#if HAVE_CUDA
PUSHPULL_H(torch_cuda_ByteTensor, THCudaByteTensor)
PUSHPULL_H(torch_cuda_IntTensor, THCudaIntTensor)
PUSHPULL_H(torch_cuda_LongTensor, THCudaLongTensor)
PUSHPULL_H(torch_cuda_FloatTensor, THCudaTensor)
PUSHPULL_H(torch_cuda_DoubleTensor, THCudaDoubleTensor)
#endif
""", "", "unused extern \"C\" declarations in TH tensor types (the functions are bound with pybind11 in ops.cc)"),
    ("byteps/torch/cuda_util.cc", "#include <THC/THC.h>\n", "#include <c10/cuda/CUDAException.h>\n",
     "THC removed: C10_CUDA_CHECK replaces THCudaCheck"),
    ("byteps/torch/cuda_util.cc", "THCudaCheck(", "C10_CUDA_CHECK(", "THCudaCheck removed (every occurrence)"),
    ("byteps/common/communicator.h", "#include <mutex>\n", "#include <memory>\n#include <mutex>\n",
     "std::shared_ptr used without <memory> (older libstdc++ pulled it in through other headers)"),
    ("byteps/torch/ops.py", "from distutils.version import LooseVersion\n", "",
     "unused import; Python 3.12 has no distutils"),
    ("byteps/common/shared_memory.cc", "  std::string shm_name(prefix);\n",
     "  const char* shm_prefix = getenv(\"BYTEPS_SHM_PREFIX\");\n"
     "  std::string shm_name(shm_prefix ? shm_prefix : \"\");\n  shm_name += prefix;\n",
     "BYTEPS_SHM_PREFIX: shared-memory names are per key only, so two workers on one host (each its own "
     "'machine', as in a one-GPU local run) would share buffers; the launcher gives each worker a prefix"),
    ("3rdparty/ps-lite/make/deps.mk", "\t$(WGET) $(ZMQ_URL) && tar --no-same-owner -zxf $(FILE)\n",
     "\tcp $(abspath ../../zeromq-4.1.4.tar.gz) . && tar --no-same-owner -zxf $(FILE)\n",
     "build the zeromq bundled in the sdist instead of downloading it (the GPU machine has no network)"),
    ("3rdparty/ps-lite/Makefile", "all: ps test\n", "all: ps\n",
     "ps-lite's own test programs are not needed (only libps.a is linked)"),
    ("byteps/server/server.cc", "<< DEBUG_PRINT_TENSOR_VALUE(updates.merged.tensor) << \"\\t\"",
     "<< (updates.merged.tensor ? DEBUG_PRINT_TENSOR_VALUE(updates.merged.tensor) : 0.f) << \"\\t\"",
     "BYTEPS_SERVER_DEBUG printed the merged buffer's first value before the engine thread had set that "
     "buffer (null until a key's first ALL_RECV in sync, non-blocking mode): the server died of a segmentation "
     "fault at the debug key's first round (seen on the GPU machine); it now prints 0 there"),
    ("byteps/torch/ops.cc", "m.def(\"byteps_torch_wait_and_clear\", &WaitAndClear);",
     "m.def(\"byteps_torch_wait_and_clear\", &WaitAndClear,\n        pybind11::call_guard<pybind11::gil_scoped_release>());",
     "synchronize() waits for its handle holding the GIL, while a BytePS thread finishing a push may need it "
     "(to drop a tensor whose Python object torch keeps alive for C++): on the GPU machine a worker's "
     "synchronize() never returned, its BytePS threads stopped mid-step (horovod#3352 is the same deadlock, "
     "fixed there the same way); the wait now releases the GIL"),
    ("byteps/common/logging.cc", "  std::ostream& os = use_cout ? std::cout : std::cerr;\n",
     "  std::ostringstream os;   // the whole line, written at once below\n",
     "a log line went out in a dozen writes, so BytePS's threads cut each other's lines at any character "
     "(at BYTEPS_LOG_LEVEL=TRACE on the GPU machine), and a test reading a line could miss it: each line is "
     "now formatted into a string (the next patch writes it)"),
    ("byteps/common/logging.cc", "       << line_ << \"] \" << str() << std::endl;\n  }\n}\n",
     "       << line_ << \"] \" << str() << std::endl;\n  }\n"
     "  (use_cout ? std::cout : std::cerr) << os.str() << std::flush;\n}\n",
     "the formatted line written to BytePS's stream in one write"),
    ("setup.py", "import traceback\n", "import traceback\n" + PARALLEL_COMPILE,
     "each extension's C++ sources compiled in parallel (MAX_JOBS threads): distutils compiles them one "
     "after another (on the GPU machine, its cores shared with the GPU tests, the build outlasted 300 s)"),
]

# Patches applied to every occurrence (the others must match exactly once).
EVERY = {("byteps/torch/ready_event.cc", "#if TORCH_VERSION >= 1005000000"),
         ("byteps/torch/cuda_util.cc", "THCudaCheck(")}


def main() -> int:
    for rel, old, new, why in PATCHES:
        path = os.path.join(SRC, rel)
        text = open(path).read()
        n = text.count(old)
        if n == 0 or (n > 1 and (rel, old) not in EVERY):
            print(f"patch_byteps: {rel}: expected pattern found {n} times ({why}):\n{old}", file=sys.stderr)
            return 1
        open(path, "w").write(text.replace(old, new))
        print(f"patched {rel}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
