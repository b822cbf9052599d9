"""The shared hash/layout header must compile as CUDA device code (the CUDA backend of a later issue
includes it unchanged). Needs only nvcc, not a GPU; skipped visibly where nvcc is absent."""
import os
import pathlib
import shutil
import subprocess

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc")

KERNEL = r"""
#include "lhc_layout.h"
__global__ void cells_kernel(lhc::SegmentedTable t, const unsigned long long* keys, unsigned long long* cells,
                             int* weights, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t c[3];
  int s[3];
  lhc::key_cells(t, keys[i], c, s);
  for (int j = 0; j < 3; ++j) { cells[3 * i + j] = c[j]; weights[3 * i + j] = s[j]; }
  if (i == 0) lhc::write_chunks(reinterpret_cast<float*>(cells), 0, lhc::key_group(t, keys[0]));
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA compile check of csrc/lhc_layout.h did not run")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_layout_header_compiles_as_device_code(tmp_path, arch):
    src = tmp_path / "layout_check.cu"
    src.write_text(KERNEL)
    cmd = [NVCC, "-std=c++17", f"-I{CSRC}", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-c", str(src),
           "-o", str(tmp_path / "layout_check.o")]
    # Under `make sanitize` the sanitizer runtimes are preloaded; nvcc must not inherit them.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
