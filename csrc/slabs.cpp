// fastmm._C: shared-memory slab creation, copies into slabs that bypass the cache, and the
// copy of decoded channels-last pixels into channel planes.
//
// It links no PyTorch library: everything is a Python buffer, so the build stays small and
// independent of the torch version. src/fastmm/_twin.py is the pure-Python twin of every
// function here; both must behave the same (tests run against both).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// Copies of this size or more bypass the cache (non-temporal stores): what lands in a slab is
// read by another process, most likely on another core, so caching it here would only evict
// the next sample, which the worker is about to make and copy. Measured on a 2-core Xeon VM:
// a fresh 2.4 MB clip copied into its slot in 0.13-0.16 ms instead of 0.24-0.26 ms.
constexpr size_t kStreamMinBytes = 256 * 1024;

void copy_out(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  if (n >= kStreamMinBytes) {
    size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;  // to a 16-byte boundary
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();  // visible before the message that says the batch is ready
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// create_slab(dir, nbytes) -> fd
// An unnamed file on the tmpfs at `dir` (O_TMPFILE), so no crash can leave it behind; falls back
// to memfd_create where the directory cannot hold one. The space is reserved now (fallocate), so a
// full /dev/shm is an ENOSPC here rather than a SIGBUS on first touch.
PyObject* create_slab(PyObject*, PyObject* args) {
  const char* dir;
  long long nbytes;
  if (!PyArg_ParseTuple(args, "sL", &dir, &nbytes)) return nullptr;
  if (nbytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "slab size must be positive");
    return nullptr;
  }
  int fd;
  int err = 0;
  Py_BEGIN_ALLOW_THREADS
  fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    fd = memfd_create("fastmm-slab", MFD_CLOEXEC);
  }
  if (fd < 0) {
    err = errno;
  } else {
    err = posix_fallocate(fd, 0, static_cast<off_t>(nbytes));
    if (err != 0) close(fd);
  }
  Py_END_ALLOW_THREADS
  if (fd < 0 || err != 0) {
    errno = err;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, dir);
  }
  return PyLong_FromLong(fd);
}

// gather(dst, offset, srcs, stride): copy srcs[i] to dst[offset + i*stride], GIL released.
// collate.py copies each sample into its slot of the batch with it as the sample is made, and
// each storage of a custom collate_fn's batch into the slab.
PyObject* gather(PyObject*, PyObject* args) {
  PyObject* dst_obj;
  Py_ssize_t offset;
  PyObject* srcs_obj;
  Py_ssize_t stride;
  if (!PyArg_ParseTuple(args, "OnOn", &dst_obj, &offset, &srcs_obj, &stride)) return nullptr;

  Py_buffer dst;
  if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return nullptr;
  PyObject* seq = PySequence_Fast(srcs_obj, "srcs must be a sequence of buffers");
  if (seq == nullptr) {
    PyBuffer_Release(&dst);
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<Py_buffer> srcs(static_cast<size_t>(n));
  Py_ssize_t acquired = 0;
  bool ok = offset >= 0 && stride >= 0;
  if (!ok) PyErr_SetString(PyExc_ValueError, "offset and stride must be non-negative");
  for (; ok && acquired < n; ++acquired) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, acquired);
    if (PyObject_GetBuffer(item, &srcs[acquired], PyBUF_C_CONTIGUOUS) != 0) {
      ok = false;
      break;
    }
    // 128-bit: no offset or stride a caller passes can wrap the sum past the check
    __int128 end = static_cast<__int128>(offset) + static_cast<__int128>(acquired) * stride +
                   srcs[acquired].len;
    if (srcs[acquired].len > stride || end > dst.len) {
      PyErr_Format(PyExc_ValueError,
                   "sample %zd (%zd bytes) does not fit its slot (slot %zd of %zd bytes after "
                   "offset %zd, buffer of %zd bytes)",
                   acquired, srcs[acquired].len, acquired, stride, offset, dst.len);
      PyBuffer_Release(&srcs[acquired]);
      ok = false;
      break;
    }
  }
  if (ok) {
    char* base = static_cast<char*>(dst.buf) + offset;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; ++i) {
      copy_out(base + i * stride, static_cast<const char*>(srcs[i].buf),
               static_cast<size_t>(srcs[i].len));
    }
    Py_END_ALLOW_THREADS
  }
  for (Py_ssize_t i = 0; i < acquired; ++i) PyBuffer_Release(&srcs[i]);
  Py_DECREF(seq);
  PyBuffer_Release(&dst);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// Channel planes out of interleaved pixels: one row of W pixels, PS bytes apart, C channels.
// Written plainly, for the compiler to vectorize (SSSE3 and AVX2 builds chosen at run time: the
// baseline x86-64 one is 6x slower, as slow as NumPy's strided copy).
template <int C, int PS>
__attribute__((target_clones("avx2", "ssse3", "default")))
void row_to_planes(uint8_t* __restrict dst, ptrdiff_t plane, const uint8_t* __restrict src,
                   ptrdiff_t width) {
  for (ptrdiff_t w = 0; w < width; ++w)
    for (int c = 0; c < C; ++c) dst[c * plane + w] = src[w * PS + c];
}

void row_to_planes_any(uint8_t* dst, ptrdiff_t plane, const uint8_t* src, ptrdiff_t width,
                       int channels, int ps) {
  for (int c = 0; c < channels; ++c)
    for (ptrdiff_t w = 0; w < width; ++w) dst[c * plane + w] = src[w * ps + c];
}

using RowFn = void (*)(uint8_t*, ptrdiff_t, const uint8_t*, ptrdiff_t);

RowFn row_fn(int channels, int ps) {
  if (channels == 3 && ps == 3) return row_to_planes<3, 3>;
  if (channels == 3 && ps == 4) return row_to_planes<3, 4>;
  if (channels == 4 && ps == 4) return row_to_planes<4, 4>;
  return nullptr;
}

// planes(dst, src): copy src, bytes viewed as (..., C, H, W) with each pixel's C channels side by
// side (strides (..., 1, row, PS), C <= PS <= 4: decoded pixels, HWC memory seen as CHW), into
// the C-contiguous dst of as many bytes, GIL released. Decoders hand out such views; collating
// them into a batch is the copy torch and NumPy make one byte at a time.
PyObject* planes(PyObject*, PyObject* args) {
  PyObject* dst_obj;
  PyObject* src_obj;
  if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return nullptr;
  Py_buffer dst;
  if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return nullptr;
  Py_buffer src;
  if (PyObject_GetBuffer(src_obj, &src, PyBUF_RECORDS_RO) != 0) {
    PyBuffer_Release(&dst);
    return nullptr;
  }
  const int nd = src.ndim;
  bool ok = src.itemsize == 1 && nd >= 3 && src.strides[nd - 3] == 1 &&
            src.shape[nd - 3] > 1 && src.strides[nd - 1] >= src.shape[nd - 3] &&
            src.strides[nd - 1] <= 4;
  if (!ok) {
    PyErr_SetString(PyExc_ValueError,
                    "src must be 1-byte elements viewed as (..., C, H, W) with each pixel's "
                    "channels side by side (strides (..., 1, row, P), 1 < C <= P <= 4)");
  } else if (dst.len != src.len) {
    ok = false;
    PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, src %zd", dst.len, src.len);
  }
  if (ok && src.len > 0) {
    const int channels = static_cast<int>(src.shape[nd - 3]);
    const int ps = static_cast<int>(src.strides[nd - 1]);
    const ptrdiff_t height = src.shape[nd - 2], width = src.shape[nd - 1];
    const ptrdiff_t row = src.strides[nd - 2], plane = height * width;
    const ptrdiff_t image_bytes = channels * plane;
    const ptrdiff_t images = src.len / image_bytes;
    RowFn fn = row_fn(channels, ps);
    Py_BEGIN_ALLOW_THREADS
    std::vector<Py_ssize_t> index(static_cast<size_t>(nd - 3), 0);  // over the leading dims
    for (ptrdiff_t i = 0; i < images; ++i) {
      const uint8_t* image = static_cast<const uint8_t*>(src.buf);
      for (int d = 0; d < nd - 3; ++d) image += index[d] * src.strides[d];
      uint8_t* out = static_cast<uint8_t*>(dst.buf) + i * image_bytes;
      for (ptrdiff_t h = 0; h < height; ++h) {
        if (fn != nullptr) {
          fn(out + h * width, plane, image + h * row, width);
        } else {
          row_to_planes_any(out + h * width, plane, image + h * row, width, channels, ps);
        }
      }
      for (int d = nd - 4; d >= 0; --d) {  // the next image, last leading dim fastest
        if (++index[d] < src.shape[d]) break;
        index[d] = 0;
      }
    }
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&dst);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"create_slab", create_slab, METH_VARARGS,
     "create_slab(dir, nbytes) -> fd: an unnamed shared-memory file with nbytes reserved."},
    {"gather", gather, METH_VARARGS,
     "gather(dst, offset, srcs, stride): copy srcs[i] into dst at offset + i*stride (GIL released)."},
    {"planes", planes, METH_VARARGS,
     "planes(dst, src): copy channels-last bytes src (..., C, H, W) into C-contiguous dst."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastmm._C",
                      "fastmm's C++ core: shared-memory slabs, copies into them past the cache, "
                      "and channels-last pixels copied into channel planes.",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
