# Sourced by the bench scripts. llama.cpp's AMX matmul
# (ggml_backend_amx_mul_mat), which it reaches through weight repacking on
# CPUs with AMX-INT8, dies with SIGSEGV on this project's Xeon VMs (ggml as
# vendored by llama-cpp-python 0.3.36, SmolLM2 Q4_1). On such CPUs the peer
# runs with repacking off, i.e. on ggml's AVX-512 VNNI kernels; elsewhere
# it keeps its default. LLAMA_REPACK=0|1 overrides the choice.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  LLAMA_REPACK="${LLAMA_REPACK:-0}"
else
  LLAMA_REPACK="${LLAMA_REPACK:-1}"
fi
# llama-server and llama-batched-bench read it from the environment.
export LLAMA_ARG_REPACK="$LLAMA_REPACK"
