# Sourced after setup.sh by calls that time FlashInfer 0.7.4 (the yardstick carried in .fi/,
# see ../shared/BENCHMARKING.md): unpack it into /tmp/site and target sm_90a.
mkdir -p /tmp/site && tar -xJf .fi/fi.tar.xz -C /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl
export FLASHINFER_CUDA_ARCH_LIST=9.0a
