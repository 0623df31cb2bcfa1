// A narrow C surface over libtorch's AOTInductor package loader
// (torch::inductor::AOTIModelPackageLoader), for worker/src/aoti.rs.
//
// Rules every function here keeps, so the Rust side can rely on them:
// - no C++ exception ever leaves a function: each body runs inside
//   try/catch, and a failure comes back as a heap string in *err (free it
//   with stoke_aoti_free_string);
// - tensors cross as torch-sys's C tensor type, a heap `at::Tensor*`:
//   inputs are borrowed (never freed here), outputs are new heap tensors
//   the caller owns (tch's Tensor::from_ptr takes them and frees them with
//   `delete`, as torch-sys's at_free does);
// - a handle from stoke_aoti_load is freed once, with stoke_aoti_free.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/headeronly/version.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
  }
  return out;
}

// c10::Error's what() carries a C++ backtrace after the message, which a
// user never needs to see: callers pass what_without_backtrace().
void set_error(char** err, const char* what) {
  if (err == nullptr) return;
  std::string msg(what == nullptr ? "unknown error" : what);
  *err = copy_string(msg);
}

// "key\x1fvalue\x1e" pairs: neither separator appears in metadata a
// package writes (JSON strings of device names, versions, ISA flags).
std::string encode_map(const std::unordered_map<std::string, std::string>& m) {
  std::string out;
  for (const auto& kv : m) {
    out += kv.first;
    out += '\x1f';
    out += kv.second;
    out += '\x1e';
  }
  return out;
}

// A package's model library names libtorch.so (and libtorch_cpu.so) as
// dependencies, without a search path. The worker binaries link
// libtorch_cpu but not libtorch.so (the linker's --as-needed drops it:
// nothing of it is called directly), and their RUNPATH does not apply to
// libraries opened later with dlopen. So libtorch.so is loaded here, from
// the folder the loaded libtorch_cpu came from, before any package: the
// package's dependency then resolves to it by its soname.
bool ensure_libtorch_loaded(char** err) {
  static std::string failure = [] {
    Dl_info info;
    auto* symbol = reinterpret_cast<void*>(
        &torch::inductor::AOTIModelPackageLoader::load_metadata_from_package);
    if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) {
      return std::string("cannot find the folder of the loaded libtorch_cpu");
    }
    std::string path(info.dli_fname);
    auto slash = path.rfind('/');
    std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    std::string libtorch = dir + "/libtorch.so";
    if (dlopen(libtorch.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* why = dlerror();
      return "loading " + libtorch + ": " + (why == nullptr ? "unknown error" : why);
    }
    return std::string();
  }();
  if (!failure.empty()) {
    set_error(err, failure.c_str());
    return false;
  }
  return true;
}

// Runs `body` (0 on success), turning whatever it throws into *err and 1:
// every entry point's error handling, written once.
template <typename F>
int guarded(char** err, F&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    set_error(err, e.what_without_backtrace());
  } catch (const std::exception& e) {
    set_error(err, e.what());
  } catch (...) {
    set_error(err, nullptr);
  }
  return 1;
}

}  // namespace

extern "C" {

typedef struct StokeAoti StokeAoti;

void stoke_aoti_free_string(char* s) { std::free(s); }

// The libtorch version these headers (and so the linked libtorch) are.
char* stoke_aoti_torch_version() {
  return copy_string(std::to_string(TORCH_VERSION_MAJOR) + "." +
                     std::to_string(TORCH_VERSION_MINOR) + "." +
                     std::to_string(TORCH_VERSION_PATCH));
}

// The package's metadata (device, platform, ISA, the exporter's own keys),
// read without loading its model: a package for another device can be
// refused before its runner is created.
int stoke_aoti_package_metadata(const char* path, char** out, char** err) {
  return guarded(err, [&]() -> int {
    auto m = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(
        path, "model");
    *out = copy_string(encode_map(m));
    return 0;
  });
}

// Loads a package for a device index (-1: the package's own device, CPU).
int stoke_aoti_load(const char* path, int device_index, StokeAoti** out,
                    char** err) {
  return guarded(err, [&]() -> int {
    if (!ensure_libtorch_loaded(err)) return 1;
    auto* loader = new torch::inductor::AOTIModelPackageLoader(
        path, "model", /*run_single_threaded=*/false, /*num_runners=*/1,
        static_cast<c10::DeviceIndex>(device_index));
    *out = reinterpret_cast<StokeAoti*>(loader);
    return 0;
  });
}

void stoke_aoti_free(StokeAoti* handle) {
  try {
    delete reinterpret_cast<torch::inductor::AOTIModelPackageLoader*>(handle);
  } catch (...) {
    // A destructor that throws has nowhere to report to; the memory is
    // the process's either way.
  }
}

// The in/out pytree specs, as the package serialized them (JSON).
int stoke_aoti_call_spec(StokeAoti* handle, char** in_spec, char** out_spec,
                         char** err) {
  return guarded(err, [&]() -> int {
    auto* loader =
        reinterpret_cast<torch::inductor::AOTIModelPackageLoader*>(handle);
    auto spec = loader->get_call_spec();
    *in_spec = copy_string(spec.size() > 0 ? spec[0] : std::string());
    *out_spec = copy_string(spec.size() > 1 ? spec[1] : std::string());
    return 0;
  });
}

// Runs the model on `n_inputs` borrowed tensors under inference mode, on
// the device's current stream. On success *outputs is a malloc'ed array
// of *n_outputs new heap tensors (free the array with
// stoke_aoti_free_tensor_array; each tensor belongs to the caller).
int stoke_aoti_run(StokeAoti* handle, at::Tensor* const* inputs,
                   size_t n_inputs, at::Tensor*** outputs, size_t* n_outputs,
                   char** err) {
  return guarded(err, [&]() -> int {
    c10::InferenceMode guard;
    auto* loader =
        reinterpret_cast<torch::inductor::AOTIModelPackageLoader*>(handle);
    std::vector<at::Tensor> in;
    in.reserve(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) in.push_back(*inputs[i]);
    // A null stream: on CUDA the runner takes the device's current stream
    // (AOTIModelContainerRunnerCuda::run_impl), the one tch works on.
    // boxed_run takes the vector's references (not the caller's tensors),
    // so the runner can free each input as soon as it is used.
    std::vector<at::Tensor> result = loader->boxed_run(std::move(in));
    auto** arr = static_cast<at::Tensor**>(
        std::malloc(sizeof(at::Tensor*) * (result.empty() ? 1 : result.size())));
    if (arr == nullptr) {
      set_error(err, "out of memory");
      return 1;
    }
    for (size_t i = 0; i < result.size(); ++i) {
      arr[i] = new at::Tensor(std::move(result[i]));
    }
    *outputs = arr;
    *n_outputs = result.size();
    return 0;
  });
}

void stoke_aoti_free_tensor_array(at::Tensor** arr) { std::free(arr); }

}  // extern "C"
