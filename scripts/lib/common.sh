# Shared by scripts/demo and scripts/test: check (and install what is missing of) what the build
# needs, find nvcc. Sourced, not executed.
#
# Minimum versions: CMake 3.25, a C++20 compiler (GCC 12+ or Clang 16+), Ninja; Catch2 (v2 or
# v3) for the tests and Google Benchmark for the benchmarks; nlohmann/json (header-only) for the
# mini-engine's checkpoint loader and traces; CLI11 (header-only) for the demo's command line;
# CUDA 13 for the GPU parts (nvcc and NCCL come with the CUDA toolkit, not from apt: without
# them the build is the host library only, MOEBIUS_WITH_CUDA=AUTO).
#
# Installing: only what is missing, with apt-get (Debian/Ubuntu). MOEBIUS_SKIP_INSTALL=1 never
# installs. Where apt-get is absent (or installing is skipped) and the tools are there, the
# scripts proceed; when one is missing they stop and name it.

moebius_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

moebius_min_cmake=3.25
moebius_min_gcc=12
moebius_min_clang=16

# version_ge A B: A >= B for dotted versions.
moebius_version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# Whether a CMake package config (Name + Config.cmake or name-config.cmake) is installed where
# find_package looks by default, or under CMAKE_PREFIX_PATH / <Name>_DIR.
moebius_have_cmake_package() {
  local name="$1" lower dirs=() d
  lower="$(printf '%s' "$name" | tr '[:upper:]' '[:lower:]')"
  local var="${name}_DIR"
  [ -n "${!var:-}" ] && [ -d "${!var}" ] && return 0
  IFS=: read -r -a dirs <<<"${CMAKE_PREFIX_PATH:-}"
  dirs+=(/usr /usr/local /opt/local)
  for d in "${dirs[@]}"; do
    [ -n "$d" ] || continue
    if compgen -G "$d/lib*/cmake/$name/${name}Config.cmake" >/dev/null ||
       compgen -G "$d/lib*/*/cmake/$name/${name}Config.cmake" >/dev/null ||
       compgen -G "$d/lib*/cmake/$lower/$lower-config.cmake" >/dev/null ||
       compgen -G "$d/lib*/*/cmake/$lower/$lower-config.cmake" >/dev/null ||
       compgen -G "$d/share/cmake/$name/${name}Config.cmake" >/dev/null; then
      return 0
    fi
  done
  return 1
}

# What is missing, as "<debian package>:<what it provides>" pairs.
moebius_missing_deps() {
  local missing=()
  if ! command -v cmake >/dev/null 2>&1; then
    missing+=("cmake:CMake >= $moebius_min_cmake")
  else
    local v
    v="$(cmake --version | head -n1 | awk '{print $3}')"
    moebius_version_ge "$v" "$moebius_min_cmake" ||
      missing+=("cmake:CMake >= $moebius_min_cmake (found $v)")
  fi
  command -v ninja >/dev/null 2>&1 || missing+=("ninja-build:Ninja")
  local cxx="${CXX:-}"
  if [ -z "$cxx" ]; then
    for c in g++ clang++ c++; do
      if command -v "$c" >/dev/null 2>&1; then cxx="$c"; break; fi
    done
  fi
  if [ -z "$cxx" ] || ! command -v "$cxx" >/dev/null 2>&1; then
    missing+=("g++:a C++20 compiler (GCC $moebius_min_gcc+ or Clang $moebius_min_clang+)")
  else
    local id major
    id="$("$cxx" --version 2>/dev/null | head -n1)"
    major="$("$cxx" -dumpversion 2>/dev/null | cut -d. -f1)"
    if [[ "$id" == *clang* ]]; then
      [ "${major:-0}" -ge "$moebius_min_clang" ] ||
        missing+=("clang:Clang $moebius_min_clang+ (found $cxx $major)")
    else
      [ "${major:-0}" -ge "$moebius_min_gcc" ] ||
        missing+=("g++:GCC $moebius_min_gcc+ (found $cxx $major)")
    fi
  fi
  moebius_have_cmake_package Catch2 || missing+=("catch2:Catch2 (tests)")
  moebius_have_cmake_package benchmark || missing+=("libbenchmark-dev:Google Benchmark (benchmarks)")
  # The mini-engine reads Hugging Face config.json, index and safetensors headers with it.
  moebius_have_cmake_package nlohmann_json ||
    missing+=("nlohmann-json3-dev:nlohmann/json (the mini-engine's checkpoint loader and traces)")
  moebius_have_cmake_package CLI11 || missing+=("libcli11-dev:CLI11 (the demo's command line)")
  printf '%s\n' "${missing[@]}"
}

moebius_install_deps() {
  local missing=() pkgs=() m
  mapfile -t missing < <(moebius_missing_deps | sed '/^$/d')
  ((${#missing[@]})) || return 0
  for m in "${missing[@]}"; do pkgs+=("${m%%:*}"); done
  if [ "${MOEBIUS_SKIP_INSTALL:-0}" != "1" ] && command -v apt-get >/dev/null 2>&1; then
    echo "moebius: installing ${pkgs[*]} (apt-get)"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${pkgs[@]}" >/dev/null
    mapfile -t missing < <(moebius_missing_deps | sed '/^$/d')
    ((${#missing[@]})) || return 0
  fi
  echo "moebius: missing, and not installed$( [ "${MOEBIUS_SKIP_INSTALL:-0}" = "1" ] &&
        echo ' (MOEBIUS_SKIP_INSTALL=1)' || command -v apt-get >/dev/null 2>&1 ||
        echo ' (no apt-get here)'):" >&2
  for m in "${missing[@]}"; do echo "  - ${m#*:} (Debian package ${m%%:*})" >&2; done
  echo "Install them, or point CMAKE_PREFIX_PATH / <Name>_DIR at them, and run again." >&2
  return 1
}

# Puts the CUDA toolkit's nvcc on PATH when it is installed but not on PATH, and warns when it
# is older than CUDA 13 (the GPU parts need 13; the host library does not).
moebius_find_nvcc() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if command -v nvcc >/dev/null 2>&1; then
    local v
    v="$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    moebius_version_ge "${v:-0}" 13 ||
      echo "moebius: nvcc $v found; the GPU parts need CUDA 13 (configure with -DMOEBIUS_WITH_CUDA=OFF to skip them)" >&2
  fi
}

moebius_jobs() { nproc 2>/dev/null || echo 2; }

# The Python packages the scripts use, from PyPI at these versions, in one virtual environment
# (build-python/venv): nanobind and scikit-build-core build the package, numpy and pytest test it,
# matplotlib draws the demo's figures (examples/mini_engine/demo/plot_runs.py); its own
# dependencies are pinned too, so that a fresh machine draws with what was tested.
moebius_python_pins=(nanobind==3.1.0 scikit-build-core==1.1.2 numpy==2.4.6 pytest==9.2.0
                     matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0
                     kiwisolver==1.5.1 packaging==26.4 pillow==13.0.0 pyparsing==3.3.3
                     python-dateutil==4.0.0)
moebius_venv="$moebius_root/build-python/venv"
# Makes (or updates) that environment with MOEBIUS_PYTHON (default python3); returns non-zero
# when it cannot (no venv module, no PyPI).
moebius_python_venv() {
  "${MOEBIUS_PYTHON:-python3}" -m venv "$moebius_venv" >/dev/null 2>&1 &&
    "$moebius_venv/bin/python" -m pip install -q --disable-pip-version-check \
      "${moebius_python_pins[@]}"
}
