// HostTier: a free list of pages over one host allocation.
#include "kv/host_tier.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace bg::kv {

HostTier::HostTier(Backend& backend, int64_t page_bytes, int64_t n_pages) : page_bytes_(page_bytes), n_pages_(n_pages) {
  BG_CHECK(page_bytes > 0 && n_pages >= 0, "host tier: bad geometry ({} pages of {} bytes)", n_pages, page_bytes);
  if (n_pages > 0) arena_ = backend.alloc_host(static_cast<size_t>(page_bytes * n_pages));
  in_use_.assign(static_cast<size_t>(n_pages), 0);
  for (int64_t p = n_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

std::vector<int32_t> HostTier::alloc(int64_t n) {
  std::vector<int32_t> out;
  if (n > n_free_pages()) return out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
    in_use_[static_cast<size_t>(out.back())] = 1;
  }
  return out;
}

void HostTier::free(std::span<const int32_t> pages) {
  for (int32_t p : pages) {
    BG_CHECK(p >= 0 && p < n_pages_ && in_use_[static_cast<size_t>(p)], "host tier: freeing page {} that is not in "
             "use", p);
    in_use_[static_cast<size_t>(p)] = 0;
    free_.push_back(p);
  }
}

std::byte* HostTier::page(int32_t p) const {
  BG_CHECK(p >= 0 && p < n_pages_, "host tier: page {} outside [0, {})", p, n_pages_);
  return arena_.get() + static_cast<size_t>(p) * static_cast<size_t>(page_bytes_);
}

std::vector<HostCopy> HostTier::copies(const Tensor& device, size_t offset, size_t bytes,
                                       std::span<const int32_t> pages) const {
  BG_CHECK(pages_for(static_cast<int64_t>(bytes)) <= static_cast<int64_t>(pages.size()), "host tier: {} bytes do "
           "not fit in {} pages of {}", bytes, pages.size(), page_bytes_);
  std::vector<HostCopy> out;
  for (size_t done = 0, i = 0; done < bytes; ++i) {
    const size_t n = std::min(bytes - done, static_cast<size_t>(page_bytes_));
    out.push_back({device, offset + done, page(pages[i]), n});
    done += n;
  }
  return out;
}

void HostTier::write(std::span<const std::byte> src, std::span<const int32_t> pages) {
  BG_CHECK(pages_for(static_cast<int64_t>(src.size())) <= static_cast<int64_t>(pages.size()), "host tier: {} bytes "
           "do not fit in {} pages", src.size(), pages.size());
  for (size_t done = 0, i = 0; done < src.size(); ++i) {
    const size_t n = std::min(src.size() - done, static_cast<size_t>(page_bytes_));
    std::memcpy(page(pages[i]), src.data() + done, n);
    done += n;
  }
}

void HostTier::read(std::span<const int32_t> pages, std::span<std::byte> dst) const {
  BG_CHECK(pages_for(static_cast<int64_t>(dst.size())) <= static_cast<int64_t>(pages.size()), "host tier: {} bytes "
           "do not fit in {} pages", dst.size(), pages.size());
  for (size_t done = 0, i = 0; done < dst.size(); ++i) {
    const size_t n = std::min(dst.size() - done, static_cast<size_t>(page_bytes_));
    std::memcpy(dst.data() + done, page(pages[i]), n);
    done += n;
  }
}

}  // namespace bg::kv
