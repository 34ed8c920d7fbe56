// Device guard, generator and PrivateUse1 hooks of the remote_accel device (the allocator
// is in allocator.cpp).
#include "device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>

namespace remote_accel {
namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// ---------------------------------------------------------------------------------------
// Device guard: one thread-local current index, one default stream per device, events
// that are always complete.

std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_current_device = 0;

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK_INDEX(index >= 0 && index < device_count(), "remote_accel: device index ",
                    static_cast<int>(index), " is out of range (device_count() is ",
                    static_cast<int>(device_count()), ")");
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDevice;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return {kDevice, t_current_device};
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDevice, "remote_accel guard got device ", d);
    if (d.index() >= 0) {  // -1 means "current": nothing to change
      check_index(d.index());
      t_current_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) {
      t_current_device = d.index();
    }
  }
  // Ops run in order on the server, per session: one stream per device is the truth.
  static c10::Stream default_stream(c10::Device d) {
    return c10::Stream(c10::Stream::DEFAULT, {kDevice, d.index() < 0 ? t_current_device : d.index()});
  }
  c10::Stream getStream(c10::Device d) const override {
    return default_stream(d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return default_stream(d);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return default_stream(d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return default_stream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return default_stream(s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  // Waiting for the server is a round trip, which Python makes (the session's sync).
  void synchronizeStream(const c10::Stream& s) const override {
    synchronizeDevice(s.device_index());
  }
  void synchronizeDevice(c10::DeviceIndex index) const override {
    if (auto* h = device_hooks()) {
      h->synchronize_device(index < 0 ? t_current_device : index);
    }
  }
  // Events. torch.Event's record() queues a marker after the ops issued so far; the
  // server notes the time (a CUDA event on a CUDA server) when its device reaches it, so
  // elapsed_time() measures the server device's own timeline. query() and synchronize()
  // ask the server. The autograd engine also records and blocks on events when a
  // gradient crosses devices (a model split over remote_accel:0 and :1): there block() has
  // nothing to order, since each server runs its session in issue order, and data reaches
  // another device only by a copy that the destination waits for. Before Python installed
  // the hooks (the C++ part loaded alone, no server to ask), events are always complete.
  struct Event {
    uint64_t id;
    c10::DeviceIndex device;
  };
  void record(void** event, const c10::Stream& stream, c10::DeviceIndex device, c10::EventFlag) const override {
    const auto index = device >= 0 ? device : stream.device_index();
    auto* e = static_cast<Event*>(*event);
    if (e == nullptr) {
      static std::atomic<uint64_t> next_id{1};
      e = new Event{next_id++, index};
      *event = e;
    }
    e->device = index;
    if (auto* h = device_hooks()) {
      h->record_event(e->device, e->id);
    }
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    auto* h = device_hooks();
    return e == nullptr || h == nullptr || h->query_event(e->device, e->id);
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (auto* h = device_hooks(); e != nullptr && h != nullptr) {
      h->synchronize_event(e->device, e->id);
    }
  }
  double elapsedTime(void* start, void* end, c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr, "remote_accel: both events must be recorded before elapsed_time()");
    TORCH_CHECK(a->device == b->device, "remote_accel: elapsed_time() between events of two devices (",
                static_cast<int>(a->device), " and ", static_cast<int>(b->device), ")");
    auto* h = device_hooks();
    TORCH_CHECK(h != nullptr, "remote_accel: the device is not registered yet (import remote_accel)");
    return h->elapsed_ms(a->device, a->id, b->id);
  }
  // The server forgets the oldest events itself (it keeps a bounded number per session).
  void destroyEvent(void* event, c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---------------------------------------------------------------------------------------
// Generator. The random numbers are drawn on the server; the client generator only names
// a stream: (id, seed, epoch) travels with every random op, and the server reseeds its own
// generator for the session whenever that triple changes. `epoch` grows on every explicit
// change of the stream (manual_seed, seed, set_state, set_offset), so reseeding to the
// same seed twice still reaches the server.
//
// Once a session exists, Python installs GeneratorStateHooks and get_state()/set_state()
// read and write the server generator's real state. Before that (no server to ask),
// they use a 16-byte uint8 CPU tensor: seed then offset, each a
// uint64 in native (little-endian) byte order, like the CUDA generator's (seed, offset).

constexpr uint64_t kDefaultSeed = 67280421310721ULL;  // c10::default_rng_seed_val
constexpr int64_t kStateBytes = 16;
std::atomic<GeneratorStateHooks*> g_state_hooks{nullptr};
std::atomic<DeviceHooks*> g_device_hooks{nullptr};
std::atomic<uint64_t> g_next_generator_id{1};

struct RemoteGenerator final : c10::GeneratorImpl {
  explicit RemoteGenerator(c10::DeviceIndex device)
      : c10::GeneratorImpl({kDevice, device}, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        id_(g_next_generator_id++) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
    ++epoch_;
  }
  void set_offset(uint64_t offset) override {
    offset_ = offset;
    ++epoch_;
  }
  uint64_t get_offset() const override {
    return offset_;
  }
  uint64_t current_seed() const override {
    return seed_;
  }
  uint64_t seed() override {
    const uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    if (auto* hooks = g_state_hooks.load()) {
      // The stream lives on the server: its state is the server generator's (as on CUDA).
      const std::string bytes = hooks->get(device_.index(), id_, seed_, epoch_);
      auto state = at::detail::empty_cpu({static_cast<int64_t>(bytes.size())}, c10::ScalarType::Byte,
                                         std::nullopt, std::nullopt, std::nullopt, std::nullopt);
      std::memcpy(state.mutable_data_ptr(), bytes.data(), bytes.size());
      return state.getIntrusivePtr();
    }
    auto state = at::detail::empty_cpu({kStateBytes}, c10::ScalarType::Byte, std::nullopt,
                                       std::nullopt, std::nullopt, std::nullopt);
    auto* out = static_cast<uint8_t*>(state.mutable_data_ptr());
    std::memcpy(out, &seed_, 8);
    std::memcpy(out + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }
  void set_state(const c10::TensorImpl& state) override {
    at::detail::check_rng_state(state);
    if (auto* hooks = g_state_hooks.load()) {
      TORCH_CHECK(state.is_contiguous(), "remote_accel generator state must be a contiguous uint8 tensor");
      // No epoch bump: the server generator now holds exactly this state, and the next op
      // must draw from it rather than reseed.
      hooks->set(device_.index(), id_, seed_, epoch_,
                 std::string(static_cast<const char*>(state.data()), state.numel()));
      return;
    }
    TORCH_CHECK(state.numel() == kStateBytes && state.is_contiguous(),
                "remote_accel generator state must be a contiguous uint8 tensor of ",
                kStateBytes, " bytes (seed, offset), got ", state.numel(), " bytes");
    const auto* in = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, in, 8);
    std::memcpy(&offset_, in + 8, 8);
    ++epoch_;
  }

  uint64_t id() const {
    return id_;
  }
  uint64_t epoch() const {
    return epoch_;
  }

 private:
  // A clone is another generator: a new id, so the server keeps its stream apart.
  RemoteGenerator* clone_impl() const override {
    auto* g = new RemoteGenerator(device_.index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }

  const uint64_t id_;
  uint64_t seed_ = kDefaultSeed;
  uint64_t offset_ = 0;
  uint64_t epoch_ = 0;
};

// ---------------------------------------------------------------------------------------
// Hooks: what PyTorch asks of any PrivateUse1 backend.

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  // The server may not be connected yet; ops then fail in Python with a clear error.
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return new_generator(device);
  }
  c10::Device getDeviceFromPtr(void* data) const override {
    return {kDevice, storage_device(data)};
  }
  // Pinned host memory: see host_cache.cpp.
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  bool isPinnedPtr(const void* ptr) const override {
    return is_pinned_ptr(ptr);
  }
  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_index(device);
    t_current_device = device;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const auto old = current_device();
    setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  // UntypedStorage.resize_(): only the cases that need no copy of remote bytes (the copy
  // would need the server, which C++ does not talk to): same size, free (to 0 bytes, as
  // FSDP does), or a fresh allocation of a storage that has no bytes.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    TORCH_CHECK(storage.resizable(), "remote_accel: trying to resize a storage that is not resizable");
    const size_t old = storage.nbytes();
    if (nbytes == old) {
      return;
    }
    TORCH_CHECK_NOT_IMPLEMENTED(nbytes == 0 || old == 0,
        "remote_accel: resizing a storage from ", old, " to ", nbytes,
        " bytes would copy its contents on the server; only resizing to or from 0 bytes is "
        "supported (resize a tensor instead)");
    c10::DeviceGuard guard(storage.device());
    storage.set_data_ptr_noswap(allocator()->allocate(nbytes));
    storage.set_nbytes(nbytes);
  }
};

const bool g_hooks_registered = [] {
  c10::SetAllocator(kDevice, allocator());
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

} // namespace

void set_device_count(int count) {
  TORCH_CHECK_VALUE(count >= 1 && count <= kMaxDevices, "remote_accel: device count must be in [1, ",
                    kMaxDevices, "], got ", count);
  g_device_count = count;
}

c10::DeviceIndex device_count() {
  return static_cast<c10::DeviceIndex>(g_device_count.load());
}

c10::DeviceIndex current_device() {
  return t_current_device;
}

const at::Generator& default_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_index(device);
  // Leaked like the registry; the references handed out must outlive every user.
  static auto* generators = new std::array<at::Generator, kMaxDevices>();
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& g = (*generators)[device];
  if (!g.defined()) {
    g = at::make_generator<RemoteGenerator>(device);
  }
  return g;
}

at::Generator new_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_index(device);
  return at::make_generator<RemoteGenerator>(device);
}

void set_generator_state_hooks(GeneratorStateHooks* hooks) {
  g_state_hooks.store(hooks);
}

void set_device_hooks(DeviceHooks* hooks) {
  g_device_hooks.store(hooks);
}

DeviceHooks* device_hooks() {
  return g_device_hooks.load();
}

uint64_t default_generator_id(c10::DeviceIndex device) {
  // id_ is immutable: no lock, so this is safe while the generator's mutex is held
  return static_cast<RemoteGenerator*>(default_generator(device).unsafeGetGeneratorImpl())->id();
}

std::tuple<uint64_t, uint64_t, uint64_t> generator_info(const at::Generator& gen) {
  auto* impl = dynamic_cast<RemoteGenerator*>(gen.unsafeGetGeneratorImpl());
  TORCH_CHECK_VALUE(impl != nullptr, "remote_accel: not a remote_accel generator (device ",
                    gen.device(), ")");
  std::lock_guard<std::mutex> lock(impl->mutex_);
  return {impl->id(), impl->current_seed(), impl->epoch()};
}

} // namespace remote_accel
