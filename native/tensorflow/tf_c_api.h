// The part of TensorFlow's C API (tensorflow/c/kernels.h, ops.h, tf_tensor.h, tf_status.h,
// tf_datatype.h) that the op library uses, declared here so that it builds without TensorFlow
// installed (`pip wheel .` in an isolated environment, the wheel's build machine). These are
// C functions that TensorFlow keeps stable across releases, which is what lets one binary serve
// TensorFlow 2.16 and later; tests/test_tf_c_api.py compiles this file after TensorFlow's own
// headers, so a declaration or a value that differs from theirs fails to compile.
//
// The types are opaque; the enums hold only the values the library uses. The status and data
// type definitions are skipped where TensorFlow's headers came first (their include guards).
#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

typedef struct TF_Tensor TF_Tensor;
typedef struct TF_OpKernelConstruction TF_OpKernelConstruction;
typedef struct TF_OpKernelContext TF_OpKernelContext;
typedef struct TF_KernelBuilder TF_KernelBuilder;
typedef struct TF_AsyncOpKernelDoneCallback TF_AsyncOpKernelDoneCallback;
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
typedef struct TF_ShapeHandle TF_ShapeHandle;

#ifndef TENSORFLOW_C_TF_DATATYPE_H_
typedef enum TF_DataType {
  TF_FLOAT = 1,
  TF_DOUBLE = 2,
  TF_INT32 = 3,
  TF_UINT8 = 4,
  TF_INT16 = 5,
  TF_INT8 = 6,
  TF_INT64 = 9,
  TF_BOOL = 10,
  TF_BFLOAT16 = 14,
  TF_UINT16 = 17,
  TF_HALF = 19,
} TF_DataType;
#endif

#ifndef TENSORFLOW_C_TF_STATUS_H_
typedef struct TF_Status TF_Status;
typedef enum TF_Code {
  TF_OK = 0,
  TF_UNKNOWN = 2,
  TF_INVALID_ARGUMENT = 3,
  TF_FAILED_PRECONDITION = 9,
  TF_UNIMPLEMENTED = 12,
} TF_Code;
#endif

// tf_status.h
TF_Status* TF_NewStatus(void);
void TF_DeleteStatus(TF_Status*);
void TF_SetStatus(TF_Status* s, TF_Code code, const char* msg);
TF_Code TF_GetCode(const TF_Status* s);

// tf_tensor.h
void TF_DeleteTensor(TF_Tensor*);
TF_DataType TF_TensorType(const TF_Tensor*);
int TF_NumDims(const TF_Tensor*);
int64_t TF_Dim(const TF_Tensor* tensor, int dim_index);
size_t TF_TensorByteSize(const TF_Tensor*);
void* TF_TensorData(const TF_Tensor*);
int64_t TF_TensorElementCount(const TF_Tensor* tensor);

// ops.h
TF_OpDefinitionBuilder* TF_NewOpDefinitionBuilder(const char* op_name);
void TF_RegisterOpDefinition(TF_OpDefinitionBuilder* builder, TF_Status* status);
void TF_OpDefinitionBuilderAddAttr(TF_OpDefinitionBuilder* builder, const char* attr_spec);
void TF_OpDefinitionBuilderAddInput(TF_OpDefinitionBuilder* builder, const char* input_spec);
void TF_OpDefinitionBuilderAddOutput(TF_OpDefinitionBuilder* builder, const char* output_spec);
void TF_OpDefinitionBuilderSetIsStateful(TF_OpDefinitionBuilder* builder, bool is_stateful);
void TF_OpDefinitionBuilderSetShapeInferenceFunction(
    TF_OpDefinitionBuilder* builder,
    void (*shape_inference_func)(TF_ShapeInferenceContext* ctx, TF_Status* status));
int64_t TF_ShapeInferenceContextNumInputs(TF_ShapeInferenceContext* ctx);
TF_ShapeHandle* TF_NewShapeHandle();
void TF_ShapeInferenceContextGetInput(TF_ShapeInferenceContext* ctx, int i,
                                      TF_ShapeHandle* handle, TF_Status* status);
void TF_ShapeInferenceContextSetOutput(TF_ShapeInferenceContext* ctx, int i,
                                       TF_ShapeHandle* handle, TF_Status* status);
void TF_DeleteShapeHandle(TF_ShapeHandle* handle);

// kernels.h
TF_KernelBuilder* TF_NewKernelBuilder(const char* op_name, const char* device_name,
                                      void* (*create_func)(TF_OpKernelConstruction*),
                                      void (*compute_func)(void*, TF_OpKernelContext*),
                                      void (*delete_func)(void*));
TF_KernelBuilder* TF_NewAsyncKernelBuilder(
    const char* op_name, const char* device_name,
    void* (*create_func)(TF_OpKernelConstruction*),
    void (*compute_async_func)(void*, TF_OpKernelContext*, TF_AsyncOpKernelDoneCallback* done),
    void (*delete_func)(void*));
void TF_RegisterKernelBuilder(const char* kernel_name, TF_KernelBuilder* builder,
                              TF_Status* status);
void TF_RunAsyncOpKernelDoneCallback(TF_AsyncOpKernelDoneCallback*);
int TF_NumInputs(TF_OpKernelContext* ctx);
void TF_GetInput(TF_OpKernelContext* ctx, int i, TF_Tensor** tensor, TF_Status* status);
void TF_SetOutput(TF_OpKernelContext* ctx, int i, const TF_Tensor* tensor, TF_Status* status);
void TF_OpKernelConstruction_Failure(TF_OpKernelConstruction* ctx, TF_Status* status);
void TF_OpKernelContext_Failure(TF_OpKernelContext* ctx, TF_Status* status);
void TF_OpKernelConstruction_GetAttrSize(TF_OpKernelConstruction* ctx, const char* attr_name,
                                         int32_t* list_size, int32_t* total_size,
                                         TF_Status* status);
void TF_OpKernelConstruction_GetAttrInt64(TF_OpKernelConstruction* ctx, const char* attr_name,
                                          int64_t* val, TF_Status* status);
void TF_OpKernelConstruction_GetAttrString(TF_OpKernelConstruction* ctx, const char* attr_name,
                                           char* val, size_t max_length, TF_Status* status);
void TF_OpKernelConstruction_GetAttrStringList(TF_OpKernelConstruction* ctx,
                                               const char* attr_name, char** values,
                                               size_t* lengths, int max_values, void* storage,
                                               size_t storage_size, TF_Status* status);
TF_Tensor* TF_ForwardInputOrAllocateOutput(TF_OpKernelContext* context,
                                           const int* candidate_input_indices,
                                           int num_candidate_input_indices, int output_index,
                                           const int64_t* output_dims, int output_num_dims,
                                           int* forwarded_input, TF_Status* status);

}  // extern "C"
