// Vectors whose resize does not zero-fill: for buffers that are written in full right after they are sized
// (an exchange's receive buffer, written by MPI), where value-initialization is one more pass over the data.
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace dpstream {

// std::allocator, except that constructing an element with no arguments default-initializes it (for a
// trivially constructible type: leaves it unwritten) instead of value-initializing it (zero).
template <class T, class Base = std::allocator<T>>
class DefaultInitAllocator : public Base {
  using Traits = std::allocator_traits<Base>;

 public:
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename Traits::template rebind_alloc<U>>;
  };
  using Base::Base;

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    Traits::construct(static_cast<Base&>(*this), p, std::forward<Args>(args)...);
  }
};

// A vector of trivially copyable items whose resize leaves the new items unwritten.
template <class T>
using DefaultInitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace dpstream
