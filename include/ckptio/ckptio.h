#pragma once
/*
 * The C API of ckptio: asynchronous, atomic checkpoints from any language
 * that can call C (link with -lckptio).
 *
 *   ckptio_manager* mgr = NULL;
 *   if (ckptio_open("/data/ckpt", NULL, &mgr) != CKPTIO_OK) {
 *     fprintf(stderr, "%s\n", ckptio_last_error());
 *     return 1;
 *   }
 *   uint64_t shape[2] = {4096, 4096};
 *   ckptio_tensor t = {"params/dense/kernel", CKPTIO_DTYPE_BF16, 2, shape, kernel};
 *   ckptio_save(mgr, step, &t, 1, NULL);   returns once the snapshot is taken
 *   ...
 *   ckptio_wait(mgr);                       every save committed (or its error)
 *   ckptio_close(mgr);
 *
 * Errors: every function that can fail returns a ckptio_status; CKPTIO_OK
 * (0) is success. After a failure, ckptio_last_error() says what failed and
 * where, e.g. "cannot save step 4 to /data/ckpt: write ...: No space left on
 * device". No C++ exception ever leaves this API: an allocation failure or a
 * bug inside ckptio comes back as CKPTIO_RESOURCE_EXHAUSTED / CKPTIO_INTERNAL.
 *
 * Threads: a manager may be used from any thread, by several at once, as the
 * C++ CheckpointManager. The last-error message is per thread.
 *
 * The C++ API (ckptio/checkpoint_manager.h) is the reference for behaviour;
 * this header documents only what is specific to C.
 */

#include <stddef.h>
#include <stdint.h>

#if defined(CKPTIO_C_BUILDING) && defined(__GNUC__)
#define CKPTIO_C_API __attribute__((visibility("default")))
#else
#define CKPTIO_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The values of ckptio::StatusCode, in the same order. */
typedef enum ckptio_status {
  CKPTIO_OK = 0,
  CKPTIO_INVALID_ARGUMENT = 1,    /* bad usage, bad config, bad input */
  CKPTIO_NOT_FOUND = 2,           /* a path, step, tensor or object that does not exist */
  CKPTIO_ALREADY_EXISTS = 3,      /* e.g. saving a step that is already committed */
  CKPTIO_FAILED_PRECONDITION = 4, /* e.g. saving through a read-only manager */
  CKPTIO_CORRUPTION = 5,          /* a CRC32C, length or header check failed */
  CKPTIO_IO_ERROR = 6,            /* the OS or the network failed */
  CKPTIO_NO_SPACE = 7,            /* ENOSPC / EDQUOT */
  CKPTIO_PERMISSION_DENIED = 8,
  CKPTIO_UNAVAILABLE = 9,         /* transient: try again later */
  CKPTIO_DEADLINE_EXCEEDED = 10,
  CKPTIO_CANCELLED = 11,
  CKPTIO_RESOURCE_EXHAUSTED = 12, /* a configured bound was hit, or out of memory */
  CKPTIO_UNIMPLEMENTED = 13,
  CKPTIO_INTERNAL = 14            /* a bug in ckptio */
} ckptio_status;

/* The values of ckptio::DType, in the same order (safetensors' names). */
typedef enum ckptio_dtype {
  CKPTIO_DTYPE_BOOL = 0,
  CKPTIO_DTYPE_U8,
  CKPTIO_DTYPE_I8,
  CKPTIO_DTYPE_U16,
  CKPTIO_DTYPE_I16,
  CKPTIO_DTYPE_F16,
  CKPTIO_DTYPE_BF16,
  CKPTIO_DTYPE_U32,
  CKPTIO_DTYPE_I32,
  CKPTIO_DTYPE_F32,
  CKPTIO_DTYPE_U64,
  CKPTIO_DTYPE_I64,
  CKPTIO_DTYPE_F64,
  CKPTIO_DTYPE_F8_E4M3,
  CKPTIO_DTYPE_F8_E5M2
} ckptio_dtype;

/* Pass as `step` to mean "the latest committed step". */
#define CKPTIO_LATEST_STEP INT64_MIN

/* A dense, C-contiguous tensor. To save: the caller's buffer, read only
 * during ckptio_save() (the default "copy" snapshot mode). From a restored
 * checkpoint: memory owned by the ckptio_checkpoint. */
typedef struct ckptio_tensor {
  const char* name;      /* "params/dense/kernel"; unique within a save */
  ckptio_dtype dtype;
  size_t ndim;           /* 0 = scalar */
  const uint64_t* shape; /* ndim entries (may be NULL when ndim is 0) */
  const void* data;      /* may be NULL only for a zero-byte tensor */
} ckptio_tensor;

/* Where a tensor sits when it is one chunk of a larger array (a shard of a
 * sharded jax.Array): the array's name and global shape, and the chunk's
 * first index on each axis (its extent is the tensor's shape). The chunks of
 * one array, from every process of a save, must tile it exactly. A chunk's
 * tensor name is "<array>@<start,...>", e.g. "params/w@0,128". */
typedef struct ckptio_chunk {
  const char* array;            /* NULL: the tensor is a whole array of its own */
  size_t ndim;                  /* the array's rank: the tensor's ndim */
  const uint64_t* global_shape; /* ndim entries */
  const uint64_t* start;        /* ndim entries */
} ckptio_chunk;

/* A caller buffer to restore into: dtype and shape must match the checkpoint. */
typedef struct ckptio_mutable_tensor {
  const char* name;
  ckptio_dtype dtype;
  size_t ndim;
  const uint64_t* shape;
  void* data;
} ckptio_mutable_tensor;

typedef struct ckptio_manager ckptio_manager;      /* opaque */
typedef struct ckptio_checkpoint ckptio_checkpoint; /* opaque: a restored checkpoint */

/* "0.1.0". */
CKPTIO_C_API const char* ckptio_version(void);

/* "InvalidArgument", "NotFound", ... ("OK" for CKPTIO_OK, "Unknown" for a value
 * outside the enum). */
CKPTIO_C_API const char* ckptio_status_name(ckptio_status status);

/* The message of the last call on this thread that failed, or "" if the last
 * call succeeded. Valid until the next ckptio call on this thread. */
CKPTIO_C_API const char* ckptio_last_error(void);

/* Opens `root` (a directory, file:// URL or gs://bucket/prefix) for writing:
 * takes the root's writer lock, removes the debris of crashed saves and
 * allocates staging memory. `config_path`: a JSON config file; NULL or ""
 * means the file named by $CKPTIO_CONFIG, or the defaults. On success *out
 * is the new manager; on failure it is set to NULL. */
CKPTIO_C_API ckptio_status ckptio_open(const char* root, const char* config_path, ckptio_manager** out);

/* Opens an existing root for reading only: no lock, no staging memory.
 * ckptio_save and ckptio_delete fail with CKPTIO_FAILED_PRECONDITION. */
CKPTIO_C_API ckptio_status ckptio_open_read_only(const char* root, const char* config_path,
                                                 ckptio_manager** out);

/* Waits for every save in flight, then frees the manager. NULL is allowed.
 * A background failure nobody collected with ckptio_wait() is dropped: call
 * ckptio_wait() first to see it. */
CKPTIO_C_API void ckptio_close(ckptio_manager* manager);

/* Snapshots `count` tensors and commits them as checkpoint `step` in the
 * background; returns once the snapshot is taken, after which the caller may
 * change or free its buffers. `metadata_json`: a JSON object stored in the
 * manifest, or NULL for {}. Fails on bad tensors, a step already committed or
 * in flight, or with the error of an earlier background save (reported once). */
CKPTIO_C_API ckptio_status ckptio_save(ckptio_manager* manager, int64_t step, const ckptio_tensor* tensors,
                                       size_t count, const char* metadata_json);

/* Blocks until no save is in flight (committed and pruned). Returns the first
 * background failure not reported yet, if any. */
CKPTIO_C_API ckptio_status ckptio_wait(ckptio_manager* manager);
/* With the config's "snapshot": "background", ckptio_save() returns before
 * the copy of the tensors, which runs on a ckptio thread: the caller may
 * change its buffers once this returns (it waits for the copy of every save
 * so far). Returns at once in the other snapshot modes. */
CKPTIO_C_API ckptio_status ckptio_wait_snapshots(ckptio_manager* manager);
/* ckptio_save() for tensors some of which are chunks of larger arrays:
 * chunks[i] says where tensors[i] sits (chunks[i].array NULL: a whole array;
 * chunks NULL: every tensor is). A chunk's tensor name must be
 * "<array>@<start,...>"; its name in tensors[i] may also be NULL, then it is
 * made so. */
CKPTIO_C_API ckptio_status ckptio_save_chunks(ckptio_manager* manager, int64_t step, const ckptio_tensor* tensors,
                                              const ckptio_chunk* chunks, size_t count, const char* metadata_json);

/* The newest committed step in *step; CKPTIO_NOT_FOUND if there is none. */
CKPTIO_C_API ckptio_status ckptio_latest_step(ckptio_manager* manager, int64_t* step);

/* The committed steps, ascending: the first min(count, capacity) go to
 * `steps` (which may be NULL when capacity is 0), the number of committed
 * steps to *count. Call with capacity 0 to size the array. */
CKPTIO_C_API ckptio_status ckptio_all_steps(ckptio_manager* manager, int64_t* steps, size_t capacity,
                                            size_t* count);

/* Lists the root again: a read-only manager sees commits made since it opened. */
CKPTIO_C_API ckptio_status ckptio_refresh(ckptio_manager* manager);

/* Deletes committed checkpoint `step` (its manifest first). */
CKPTIO_C_API ckptio_status ckptio_delete(ckptio_manager* manager, int64_t step);

/* Reads checkpoint `step` (or CKPTIO_LATEST_STEP), checking every length,
 * offset and CRC32C. On success *out owns the tensors; free it with
 * ckptio_checkpoint_free(). */
CKPTIO_C_API ckptio_status ckptio_restore(ckptio_manager* manager, int64_t step, ckptio_checkpoint** out);

/* Reads the named tensors straight into caller buffers; the step read goes to
 * *step_read (which may be NULL). */
CKPTIO_C_API ckptio_status ckptio_restore_into(ckptio_manager* manager, int64_t step,
                                               const ckptio_mutable_tensor* tensors, size_t count,
                                               int64_t* step_read);

/* A restored checkpoint. Every pointer it hands out stays valid until
 * ckptio_checkpoint_free(). */
CKPTIO_C_API int64_t ckptio_checkpoint_step(const ckptio_checkpoint* checkpoint);
/* The metadata JSON given to the save ("{}" if none). */
CKPTIO_C_API const char* ckptio_checkpoint_metadata(const ckptio_checkpoint* checkpoint);
CKPTIO_C_API size_t ckptio_checkpoint_tensor_count(const ckptio_checkpoint* checkpoint);
/* Tensor `index` (in saved order) into *out. */
CKPTIO_C_API ckptio_status ckptio_checkpoint_tensor(const ckptio_checkpoint* checkpoint, size_t index,
                                                    ckptio_tensor* out);
/* The tensor called `name` into *out; CKPTIO_NOT_FOUND if there is none. */
CKPTIO_C_API ckptio_status ckptio_checkpoint_find(const ckptio_checkpoint* checkpoint, const char* name,
                                                  ckptio_tensor* out);
/* Where tensor `index` sits in its array (*out's array is NULL for a tensor
 * that is a whole array of its own). */
CKPTIO_C_API ckptio_status ckptio_checkpoint_chunk(const ckptio_checkpoint* checkpoint, size_t index,
                                                   ckptio_chunk* out);
/* NULL is allowed. */
CKPTIO_C_API void ckptio_checkpoint_free(ckptio_checkpoint* checkpoint);

/* Bytes per element of `dtype` (0 for a value outside the enum). */
CKPTIO_C_API size_t ckptio_dtype_size(ckptio_dtype dtype);

#ifdef __cplusplus
}  /* extern "C" */
#endif
