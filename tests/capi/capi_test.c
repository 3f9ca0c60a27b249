/* Tests of the C API (include/ckptio/ckptio.h), written in C99 and compiled
 * as C: they also prove the header is plain C. Each case is a function that
 * returns the number of failed checks; main() prints a doctest-style summary
 * line so tests/tools/summarize.py counts the cases one by one. */
#define _XOPEN_SOURCE 700

#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptio/ckptio.h"

static int g_checks_failed;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++g_checks_failed;                                                   \
    }                                                                      \
  } while (0)

/* An OK status, or the failure and its message on stderr. */
#define CHECK_OK(expr)                                                     \
  do {                                                                     \
    ckptio_status s_ = (expr);                                             \
    if (s_ != CKPTIO_OK) {                                                 \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr,  \
              ckptio_status_name(s_), ckptio_last_error());                \
      ++g_checks_failed;                                                   \
    }                                                                      \
  } while (0)

static int remove_entry(const char* path, const struct stat* sb, int flag, struct FTW* ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

/* A fresh directory under $TMPDIR (or /tmp) holding a config file with small
 * staging memory and the given keep. `root` gets "<dir>/ckpt". */
typedef struct scratch {
  char dir[512];
  char root[600];
  char config[600];
} scratch;

static void scratch_make_with(scratch* s, int keep, const char* more) {
  const char* base = getenv("TMPDIR");
  snprintf(s->dir, sizeof s->dir, "%s/ckptio-capi-XXXXXX", base && *base ? base : "/tmp");
  if (mkdtemp(s->dir) == NULL) {
    perror("mkdtemp");
    exit(2);
  }
  snprintf(s->root, sizeof s->root, "%s/ckpt", s->dir);
  snprintf(s->config, sizeof s->config, "%s/ckptio.json", s->dir);
  FILE* f = fopen(s->config, "w");
  if (f == NULL) {
    perror("fopen");
    exit(2);
  }
  fprintf(f, "{\"staging_memory\": \"16MiB\", \"keep\": %d, \"threads\": 2%s}\n", keep, more);
  fclose(f);
}

static void scratch_make(scratch* s, int keep) { scratch_make_with(s, keep, ""); }

static void scratch_remove(scratch* s) { nftw(s->dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* The state of a small trainer: a float matrix, bfloat16 bits, a step counter
 * and an empty tensor. */
static float g_kernel[2][3] = {{1.5f, -2.0f, 3.25f}, {0.0f, 1e-3f, -7.0f}};
static uint16_t g_bf16[4] = {0x3f80, 0x4000, 0xbf80, 0x7f80}; /* 1, 2, -1, inf */
static int64_t g_counter = 42;
static const uint64_t g_kernel_shape[2] = {2, 3};
static const uint64_t g_bf16_shape[1] = {4};
static const uint64_t g_empty_shape[2] = {0, 5};

static void state_tensors(ckptio_tensor out[4]) {
  ckptio_tensor t0 = {"params/dense/kernel", CKPTIO_DTYPE_F32, 2, g_kernel_shape, g_kernel};
  ckptio_tensor t1 = {"params/dense/bias_bf16", CKPTIO_DTYPE_BF16, 1, g_bf16_shape, g_bf16};
  ckptio_tensor t2 = {"opt/step", CKPTIO_DTYPE_I64, 0, NULL, &g_counter};
  ckptio_tensor t3 = {"empty", CKPTIO_DTYPE_U8, 2, g_empty_shape, NULL};
  out[0] = t0;
  out[1] = t1;
  out[2] = t2;
  out[3] = t3;
}

static int test_save_wait_restore_round_trip_bit_exact(void) {
  scratch s;
  scratch_make(&s, 3);
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  CHECK(mgr != NULL);
  if (mgr == NULL) return 1;
  ckptio_tensor tensors[4];
  state_tensors(tensors);
  CHECK_OK(ckptio_save(mgr, 10, tensors, 4, "{\"epoch\": 3}"));
  CHECK_OK(ckptio_wait(mgr));
  int64_t latest = -1;
  CHECK_OK(ckptio_latest_step(mgr, &latest));
  CHECK(latest == 10);

  ckptio_checkpoint* ckpt = NULL;
  CHECK_OK(ckptio_restore(mgr, CKPTIO_LATEST_STEP, &ckpt));
  if (ckpt != NULL) {
    CHECK(ckptio_checkpoint_step(ckpt) == 10);
    CHECK(strstr(ckptio_checkpoint_metadata(ckpt), "\"epoch\"") != NULL);
    CHECK(ckptio_checkpoint_tensor_count(ckpt) == 4);
    ckptio_tensor t;
    CHECK_OK(ckptio_checkpoint_find(ckpt, "params/dense/kernel", &t));
    CHECK(t.dtype == CKPTIO_DTYPE_F32 && t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 3);
    CHECK(t.data != NULL && memcmp(t.data, g_kernel, sizeof g_kernel) == 0);
    CHECK_OK(ckptio_checkpoint_find(ckpt, "params/dense/bias_bf16", &t));
    CHECK(t.dtype == CKPTIO_DTYPE_BF16 && t.ndim == 1 && t.shape[0] == 4);
    CHECK(t.data != NULL && memcmp(t.data, g_bf16, sizeof g_bf16) == 0);
    CHECK_OK(ckptio_checkpoint_find(ckpt, "opt/step", &t));
    CHECK(t.dtype == CKPTIO_DTYPE_I64 && t.ndim == 0);
    CHECK(t.data != NULL && *(const int64_t*)t.data == 42);
    CHECK_OK(ckptio_checkpoint_find(ckpt, "empty", &t));
    CHECK(t.ndim == 2 && t.shape[0] == 0 && t.shape[1] == 5);
    /* In saved order by index. */
    CHECK_OK(ckptio_checkpoint_tensor(ckpt, 0, &t));
    CHECK(strcmp(t.name, "params/dense/kernel") == 0);
    CHECK(ckptio_checkpoint_tensor(ckpt, 4, &t) == CKPTIO_INVALID_ARGUMENT);
    CHECK(ckptio_checkpoint_find(ckpt, "nope", &t) == CKPTIO_NOT_FOUND);
    CHECK(strstr(ckptio_last_error(), "nope") != NULL);
  }
  ckptio_checkpoint_free(ckpt);
  ckptio_close(mgr);
  scratch_remove(&s);
  return 0;
}

static int test_save_returns_after_the_snapshot_so_buffers_may_change(void) {
  scratch s;
  scratch_make(&s, 3);
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  if (mgr == NULL) return 1;
  float values[1024];
  for (int i = 0; i < 1024; ++i) values[i] = (float)i;
  uint64_t shape[1] = {1024};
  ckptio_tensor t = {"x", CKPTIO_DTYPE_F32, 1, shape, values};
  CHECK_OK(ckptio_save(mgr, 1, &t, 1, NULL));
  for (int i = 0; i < 1024; ++i) values[i] = -1.0f; /* the trainer moves on at once */
  CHECK_OK(ckptio_wait(mgr));
  float back[1024];
  ckptio_mutable_tensor into = {"x", CKPTIO_DTYPE_F32, 1, shape, back};
  int64_t read = -1;
  CHECK_OK(ckptio_restore_into(mgr, CKPTIO_LATEST_STEP, &into, 1, &read));
  CHECK(read == 1);
  int same = 1;
  for (int i = 0; i < 1024; ++i) same = same && back[i] == (float)i;
  CHECK(same);
  ckptio_close(mgr);
  scratch_remove(&s);
  return 0;
}

/* snapshot "background": the buffers may change once ckptio_wait_snapshots() returns. */
static int test_background_snapshots_are_taken_by_wait_snapshots(void) {
  scratch s;
  scratch_make_with(&s, 0, ", \"snapshot\": \"background\"");
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  if (mgr == NULL) return 1;
  static float values[1 << 16];
  uint64_t shape[1] = {1 << 16};
  ckptio_tensor t = {"x", CKPTIO_DTYPE_F32, 1, shape, values};
  for (int step = 1; step <= 3; ++step) {
    for (int i = 0; i < (1 << 16); ++i) values[i] = (float)(i + step);
    CHECK_OK(ckptio_save(mgr, step, &t, 1, NULL));
    CHECK_OK(ckptio_wait_snapshots(mgr));
    for (int i = 0; i < (1 << 16); ++i) values[i] = -1.0f; /* the optimizer step */
  }
  CHECK_OK(ckptio_wait(mgr));
  static float back[1 << 16];
  ckptio_mutable_tensor into = {"x", CKPTIO_DTYPE_F32, 1, shape, back};
  for (int step = 1; step <= 3; ++step) {
    int64_t read = -1;
    CHECK_OK(ckptio_restore_into(mgr, step, &into, 1, &read));
    CHECK(read == step);
    int same = 1;
    for (int i = 0; i < (1 << 16); ++i) same = same && back[i] == (float)(i + step);
    CHECK(same);
  }
  CHECK(ckptio_wait_snapshots(NULL) == CKPTIO_INVALID_ARGUMENT);
  ckptio_close(mgr);
  scratch_remove(&s);
  return 0;
}

static int test_all_steps_are_ascending_and_keep_prunes_the_oldest(void) {
  scratch s;
  scratch_make(&s, 2);
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  if (mgr == NULL) return 1;
  size_t count = 99;
  CHECK_OK(ckptio_all_steps(mgr, NULL, 0, &count));
  CHECK(count == 0);
  int64_t latest = 0;
  CHECK(ckptio_latest_step(mgr, &latest) == CKPTIO_NOT_FOUND);
  CHECK(strlen(ckptio_last_error()) > 0);
  ckptio_tensor tensors[4];
  state_tensors(tensors);
  for (int64_t step = 100; step <= 400; step += 100) CHECK_OK(ckptio_save(mgr, step, tensors, 4, NULL));
  CHECK_OK(ckptio_wait(mgr));
  CHECK_OK(ckptio_all_steps(mgr, NULL, 0, &count));
  CHECK(count == 2);
  int64_t steps[4] = {0, 0, 0, 0};
  CHECK_OK(ckptio_all_steps(mgr, steps, 4, &count));
  CHECK(count == 2 && steps[0] == 300 && steps[1] == 400);
  CHECK_OK(ckptio_all_steps(mgr, steps, 1, &count)); /* too small: the first ones, and the count */
  CHECK(count == 2 && steps[0] == 300);
  CHECK_OK(ckptio_delete(mgr, 400));
  CHECK_OK(ckptio_latest_step(mgr, &latest));
  CHECK(latest == 300);
  ckptio_close(mgr);
  scratch_remove(&s);
  return 0;
}

static int test_a_reader_sees_new_commits_after_refresh(void) {
  scratch s;
  scratch_make(&s, 3);
  ckptio_manager* writer = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &writer));
  if (writer == NULL) return 1;
  ckptio_tensor tensors[4];
  state_tensors(tensors);
  CHECK_OK(ckptio_save(writer, 1, tensors, 4, NULL));
  CHECK_OK(ckptio_wait(writer));
  ckptio_manager* reader = NULL;
  CHECK_OK(ckptio_open_read_only(s.root, s.config, &reader));
  if (reader == NULL) return 1;
  CHECK_OK(ckptio_save(writer, 2, tensors, 4, NULL));
  CHECK_OK(ckptio_wait(writer));
  int64_t latest = 0;
  CHECK_OK(ckptio_latest_step(reader, &latest));
  CHECK(latest == 1);
  CHECK_OK(ckptio_refresh(reader));
  CHECK_OK(ckptio_latest_step(reader, &latest));
  CHECK(latest == 2);
  CHECK(ckptio_save(reader, 3, tensors, 4, NULL) == CKPTIO_FAILED_PRECONDITION);
  CHECK(strstr(ckptio_last_error(), "read-only") != NULL);
  ckptio_close(reader);
  ckptio_close(writer);
  scratch_remove(&s);
  return 0;
}

static int test_errors_come_back_as_codes_with_the_message(void) {
  scratch s;
  scratch_make(&s, 3);
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  if (mgr == NULL) return 1;
  ckptio_tensor tensors[4];
  state_tensors(tensors);
  CHECK_OK(ckptio_save(mgr, 5, tensors, 4, NULL));
  CHECK_OK(ckptio_wait(mgr));

  /* A step that is already committed. */
  CHECK(ckptio_save(mgr, 5, tensors, 4, NULL) == CKPTIO_ALREADY_EXISTS);
  CHECK(strstr(ckptio_last_error(), "already exists") != NULL);
  /* Success clears the message. */
  int64_t latest = 0;
  CHECK_OK(ckptio_latest_step(mgr, &latest));
  CHECK(strcmp(ckptio_last_error(), "") == 0);
  /* A step that does not exist. */
  ckptio_checkpoint* ckpt = (ckptio_checkpoint*)&latest; /* must be reset to NULL */
  CHECK(ckptio_restore(mgr, 999, &ckpt) == CKPTIO_NOT_FOUND);
  CHECK(ckpt == NULL);
  CHECK(strstr(ckptio_last_error(), "999") != NULL);
  /* Bad tensors: an enum value out of range, a duplicate name, a NULL name. */
  ckptio_tensor bad = tensors[0];
  bad.dtype = (ckptio_dtype)99;
  CHECK(ckptio_save(mgr, 6, &bad, 1, NULL) == CKPTIO_INVALID_ARGUMENT);
  CHECK(strstr(ckptio_last_error(), "unknown dtype value 99") != NULL);
  ckptio_tensor twice[2] = {tensors[0], tensors[0]};
  CHECK(ckptio_save(mgr, 6, twice, 2, NULL) == CKPTIO_INVALID_ARGUMENT);
  CHECK(strstr(ckptio_last_error(), "params/dense/kernel") != NULL);
  bad = tensors[0];
  bad.name = NULL;
  CHECK(ckptio_save(mgr, 6, &bad, 1, NULL) == CKPTIO_INVALID_ARGUMENT);
  /* Metadata that is not a JSON object. */
  CHECK(ckptio_save(mgr, 6, tensors, 4, "[1, 2]") == CKPTIO_INVALID_ARGUMENT);
  /* NULL handles and outputs. */
  CHECK(ckptio_wait(NULL) == CKPTIO_INVALID_ARGUMENT);
  CHECK(strstr(ckptio_last_error(), "manager is NULL") != NULL);
  CHECK(ckptio_latest_step(mgr, NULL) == CKPTIO_INVALID_ARGUMENT);
  /* A second writer on the same root fails while the first is open. */
  ckptio_manager* second = (ckptio_manager*)&latest;
  CHECK(ckptio_open(s.root, s.config, &second) != CKPTIO_OK);
  CHECK(second == NULL);
  CHECK(strlen(ckptio_last_error()) > 0);
  ckptio_close(mgr);

  /* A config file with a typo: the error names the file and the key. */
  char bad_config[700];
  snprintf(bad_config, sizeof bad_config, "%s/bad.json", s.dir);
  FILE* f = fopen(bad_config, "w");
  if (f != NULL) {
    fputs("{\"keep\": 2, \"stagin_memory\": \"1GiB\"}\n", f);
    fclose(f);
  }
  CHECK(ckptio_open(s.root, bad_config, &mgr) == CKPTIO_INVALID_ARGUMENT);
  CHECK(mgr == NULL);
  CHECK(strstr(ckptio_last_error(), "stagin_memory") != NULL);
  CHECK(strstr(ckptio_last_error(), bad_config) != NULL);
  /* A read-only open of a root that does not exist. */
  char missing[700];
  snprintf(missing, sizeof missing, "%s/does-not-exist", s.dir);
  ckptio_status st = ckptio_open_read_only(missing, s.config, &mgr);
  CHECK(st == CKPTIO_NOT_FOUND);
  CHECK(strstr(ckptio_last_error(), "does-not-exist") != NULL);
  ckptio_close(mgr); /* NULL: allowed */
  scratch_remove(&s);
  return 0;
}

static int test_names_and_sizes_of_the_enums(void) {
  CHECK(strcmp(ckptio_status_name(CKPTIO_OK), "OK") == 0);
  CHECK(strcmp(ckptio_status_name(CKPTIO_NOT_FOUND), "NotFound") == 0);
  CHECK(strcmp(ckptio_status_name(CKPTIO_INTERNAL), "Internal") == 0);
  CHECK(ckptio_dtype_size(CKPTIO_DTYPE_BF16) == 2);
  CHECK(ckptio_dtype_size(CKPTIO_DTYPE_F8_E5M2) == 1);
  CHECK(ckptio_dtype_size(CKPTIO_DTYPE_F64) == 8);
  CHECK(ckptio_dtype_size((ckptio_dtype)77) == 0);
  CHECK(strcmp(ckptio_status_name((ckptio_status)42), "Unknown") == 0);
  CHECK(strlen(ckptio_version()) > 0);
  return 0;
}

typedef struct test_case {
  const char* name;
  int (*fn)(void);
} test_case;

/* A 4x4 float array saved as four 2x2 chunks (their names made from the
 * array's), next to a plain tensor; the restore says where each chunk sits. */
static int test_chunks_of_an_array_round_trip_with_their_place(void) {
  scratch s;
  scratch_make(&s, 3);
  ckptio_manager* mgr = NULL;
  CHECK_OK(ckptio_open(s.root, s.config, &mgr));
  if (mgr == NULL) return 1;
  static const uint64_t global[2] = {4, 4};
  static const uint64_t chunk_shape[2] = {2, 2};
  static const uint64_t starts[4][2] = {{0, 0}, {0, 2}, {2, 0}, {2, 2}};
  float blocks[4][2][2];
  ckptio_tensor tensors[5];
  ckptio_chunk chunks[5];
  for (int i = 0; i < 4; ++i) {
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 2; ++c) blocks[i][r][c] = (float)((starts[i][0] + r) * 4 + starts[i][1] + c);
    ckptio_tensor t = {NULL, CKPTIO_DTYPE_F32, 2, chunk_shape, blocks[i]};
    ckptio_chunk k = {"params/w", 2, global, starts[i]};
    tensors[i] = t;
    chunks[i] = k;
  }
  ckptio_tensor plain = {"opt/step", CKPTIO_DTYPE_I64, 0, NULL, &g_counter};
  ckptio_chunk none = {NULL, 0, NULL, NULL};
  tensors[4] = plain;
  chunks[4] = none;
  CHECK_OK(ckptio_save_chunks(mgr, 1, tensors, chunks, 5, NULL));
  CHECK_OK(ckptio_wait(mgr));
  /* Chunks that do not tile their array are refused, naming it. */
  CHECK(ckptio_save_chunks(mgr, 2, tensors, chunks, 3, NULL) == CKPTIO_INVALID_ARGUMENT);
  CHECK(strstr(ckptio_last_error(), "params/w") != NULL);
  ckptio_chunk flat = {"params/w", 1, global, starts[0]};
  CHECK(ckptio_save_chunks(mgr, 2, tensors, &flat, 1, NULL) == CKPTIO_INVALID_ARGUMENT);
  CHECK(strstr(ckptio_last_error(), "axes") != NULL);

  ckptio_checkpoint* ckpt = NULL;
  CHECK_OK(ckptio_restore(mgr, 1, &ckpt));
  if (ckpt != NULL) {
    CHECK(ckptio_checkpoint_tensor_count(ckpt) == 5);
    int seen = 0;
    for (size_t i = 0; i < ckptio_checkpoint_tensor_count(ckpt); ++i) {
      ckptio_tensor t;
      ckptio_chunk k;
      CHECK_OK(ckptio_checkpoint_tensor(ckpt, i, &t));
      CHECK_OK(ckptio_checkpoint_chunk(ckpt, i, &k));
      if (strcmp(t.name, "opt/step") == 0) {
        CHECK(k.array == NULL && k.ndim == 0);
        continue;
      }
      CHECK(k.array != NULL && strcmp(k.array, "params/w") == 0);
      CHECK(k.ndim == 2 && k.global_shape[0] == 4 && k.global_shape[1] == 4);
      /* The chunk's values are its place in the array: row * 4 + column. */
      const float* v = (const float*)t.data;
      CHECK(t.ndim == 2 && t.shape[0] == 2 && t.shape[1] == 2);
      CHECK(v[0] == (float)(k.start[0] * 4 + k.start[1]) && v[3] == (float)((k.start[0] + 1) * 4 + k.start[1] + 1));
      char name[64];
      snprintf(name, sizeof name, "params/w@%llu,%llu", (unsigned long long)k.start[0], (unsigned long long)k.start[1]);
      CHECK(strcmp(t.name, name) == 0);
      ++seen;
    }
    CHECK(seen == 4);
    ckptio_chunk k;
    CHECK(ckptio_checkpoint_chunk(ckpt, 5, &k) == CKPTIO_INVALID_ARGUMENT);
  }
  ckptio_checkpoint_free(ckpt);
  ckptio_close(mgr);
  scratch_remove(&s);
  return 0;
}

int main(void) {
  static const test_case cases[] = {
      {"save, wait and restore round-trip bit-exact", test_save_wait_restore_round_trip_bit_exact},
      {"save returns after the snapshot, so buffers may change",
       test_save_returns_after_the_snapshot_so_buffers_may_change},
      {"background snapshots are taken by wait_snapshots", test_background_snapshots_are_taken_by_wait_snapshots},
      {"all steps are ascending and keep prunes the oldest", test_all_steps_are_ascending_and_keep_prunes_the_oldest},
      {"a reader sees new commits after refresh", test_a_reader_sees_new_commits_after_refresh},
      {"errors come back as codes with the message", test_errors_come_back_as_codes_with_the_message},
      {"names and sizes of the enums", test_names_and_sizes_of_the_enums},
      {"chunks of an array round-trip with their place", test_chunks_of_an_array_round_trip_with_their_place},
  };
  const int n = (int)(sizeof cases / sizeof cases[0]);
  int failed = 0;
  for (int i = 0; i < n; ++i) {
    int before = g_checks_failed;
    int early = cases[i].fn();
    int ok = early == 0 && g_checks_failed == before;
    printf("%s: %s\n", ok ? "ok  " : "FAIL", cases[i].name);
    failed += !ok;
  }
  /* The line tests/tools/summarize.py reads from doctest executables. */
  printf("[doctest] test cases: %d | %d passed | %d failed |\n", n, n - failed, failed);
  return failed == 0 ? 0 : 1;
}
