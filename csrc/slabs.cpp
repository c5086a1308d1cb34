// fastmm._C: shared-memory slab creation and copies into slabs on raw buffers.
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

#include <cstring>
#include <vector>

namespace {

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
// The pickler in collate.py copies each storage a batch uses into the slab with it.
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
      std::memcpy(base + i * stride, srcs[i].buf, static_cast<size_t>(srcs[i].len));
    }
    Py_END_ALLOW_THREADS
  }
  for (Py_ssize_t i = 0; i < acquired; ++i) PyBuffer_Release(&srcs[i]);
  Py_DECREF(seq);
  PyBuffer_Release(&dst);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"create_slab", create_slab, METH_VARARGS,
     "create_slab(dir, nbytes) -> fd: an unnamed shared-memory file with nbytes reserved."},
    {"gather", gather, METH_VARARGS,
     "gather(dst, offset, srcs, stride): copy srcs[i] into dst at offset + i*stride (GIL released)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastmm._C", "fastmm's C++ slab and collation core.",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
