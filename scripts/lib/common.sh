# Shared by scripts/demo and scripts/test: install what the build needs, find nvcc.
# Sourced, not executed.

moebius_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Debian packages the build uses. nvcc and NCCL come with the CUDA toolkit, not from apt:
# without them the build is the host library only (MOEBIUS_WITH_CUDA=AUTO).
moebius_packages=(cmake ninja-build g++ catch2 libbenchmark-dev)

moebius_install_deps() {
  local missing=()
  for p in "${moebius_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "moebius: installing ${missing[*]} (apt-get)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Puts the CUDA toolkit's nvcc on PATH when it is installed but not on PATH.
moebius_find_nvcc() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
}

moebius_jobs() { nproc 2>/dev/null || echo 2; }
