// Sparse COO and compressed (CSR/CSC/BSR/BSC) tensors on remote_accel.
//
// A sparse tensor's key is SparsePrivateUse1 or SparseCsrPrivateUse1, not PrivateUse1: the
// dispatcher never walks down to the dense key's kernels or fallback, and torch registers
// nothing for these keys. A sparse remote_accel tensor is, as on CUDA, a SparseTensorImpl
// (or SparseCsrTensorImpl) holding ordinary remote tensors: indices and values, or
// compressed indices, plain indices and values. So the kernels below are ATen's own
// device-generic ones that only build, read or move those component tensors (their
// dense work lands in the PrivateUse1 fallback like any other op). Every op that computes
// on a sparse tensor reaches the Python fallback that pytorch_ext/sparse.py installs at
// both keys, which runs it on the server: the server rebuilds the sparse tensor from the
// components' storages and sends a sparse result back as its components.
#include <ATen/ops/_coalesced_native.h>
#include <ATen/ops/_dimI_native.h>
#include <ATen/ops/_dimV_native.h>
#include <ATen/ops/_indices_native.h>
#include <ATen/ops/_nnz_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <ATen/ops/_values_native.h>
#include <ATen/ops/ccol_indices_native.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/col_indices_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/copy_sparse_to_sparse_native.h>
#include <ATen/ops/crow_indices_native.h>
#include <ATen/ops/dense_dim_native.h>
#include <ATen/ops/empty_native.h>
#include <ATen/ops/indices_native.h>
#include <ATen/ops/is_coalesced_native.h>
#include <ATen/ops/row_indices_native.h>
#include <ATen/ops/sparse_dim_native.h>
#include <ATen/ops/sparse_resize_and_clear_native.h>
#include <ATen/ops/sparse_resize_native.h>
#include <ATen/ops/values_native.h>
#include <torch/library.h>

TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  // construction: these pick the sparse key from the options' device, so they build a
  // SparseTensorImpl for remote_accel around the given (remote) indices and values
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
  m.impl("_sparse_coo_tensor_with_dims_and_tensors", TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse));
  // metadata of the SparseTensorImpl itself
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_dimI", TORCH_FN(at::native::sparse_dim_sparse));
  m.impl("_dimV", TORCH_FN(at::native::dense_dim_sparse));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse));
  m.impl("is_coalesced", TORCH_FN(at::native::is_coalesced_sparse));
  m.impl("_coalesced_", TORCH_FN(at::native::_coalesced_sparse_));
  m.impl("_indices", TORCH_FN(at::native::_indices_sparse));
  m.impl("_values", TORCH_FN(at::native::_values_sparse));
  m.impl("indices", TORCH_FN(at::native::indices_sparse));
  m.impl("values", TORCH_FN(at::native::values_sparse));
  // these move the components with dense ops (clone, copy_, empty)
  m.impl("clone", TORCH_FN(at::native::clone_sparse));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_wrapper_));
  m.impl("copy_sparse_to_sparse_", TORCH_FN(at::native::copy_sparse_));
  m.impl("sparse_resize_", TORCH_FN(at::native::sparse_resize_));
  m.impl("sparse_resize_and_clear_", TORCH_FN(at::native::sparse_resize_and_clear_));
}

TORCH_LIBRARY_IMPL(aten, SparseCsrPrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(at::native::empty_sparse_compressed));
  m.impl("sparse_dim", TORCH_FN(at::native::sparse_dim_sparse_csr));
  m.impl("dense_dim", TORCH_FN(at::native::dense_dim_sparse_csr));
  m.impl("_nnz", TORCH_FN(at::native::_nnz_sparse_csr));
  m.impl("values", TORCH_FN(at::native::values_sparse_csr));
  m.impl("crow_indices", TORCH_FN(at::native::crow_indices_sparse_csr));
  m.impl("col_indices", TORCH_FN(at::native::col_indices_sparse_csr));
  m.impl("ccol_indices", TORCH_FN(at::native::ccol_indices_sparse_csr));
  m.impl("row_indices", TORCH_FN(at::native::row_indices_sparse_csr));
  m.impl("clone", TORCH_FN(at::native::clone_sparse_compressed));
  m.impl("copy_", TORCH_FN(at::native::copy_sparse_compressed_));
}
