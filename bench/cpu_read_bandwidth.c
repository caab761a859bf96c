/* Read bandwidth of this machine for 1..N threads over buffers larger than the caches: the
 * ceiling of a memory-bound CPU decode step (a float32 GEMV reads every weight once per token).
 *
 *     gcc -O2 -mavx512f -pthread bench/cpu_read_bandwidth.c -o /tmp/cpu_read_bandwidth
 *     /tmp/cpu_read_bandwidth THREADS MIB      e.g. 1 256, then 2 256
 *
 * Each thread sums its half (third, ...) of the buffer with 512-bit loads; the threads start each
 * of 8 passes together (a barrier) and a pass lasts until the last one is done (wall time); the
 * best pass counts. Prints GB/s of all threads together. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static size_t n_floats;
static float* buf;
static int n_threads;
static double best = 1e9;
static pthread_barrier_t barrier;
volatile float sink;

static double wall_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* reader(void* arg) {
  const long id = (long)arg;
  const size_t lo = n_floats * id / n_threads / 64 * 64, hi = n_floats * (id + 1) / n_threads / 64 * 64;
  for (int pass = 0; pass < 8; ++pass) {
    pthread_barrier_wait(&barrier);
    const double t = wall_now();
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = lo; i < hi; i += 64) {
      s0 = _mm512_add_ps(s0, _mm512_load_ps(buf + i));
      s1 = _mm512_add_ps(s1, _mm512_load_ps(buf + i + 16));
      s2 = _mm512_add_ps(s2, _mm512_load_ps(buf + i + 32));
      s3 = _mm512_add_ps(s3, _mm512_load_ps(buf + i + 48));
    }
    sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    pthread_barrier_wait(&barrier);
    const double dt = wall_now() - t;
    if (id == 0 && dt < best) best = dt;
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 3 || atoi(argv[1]) < 1 || atoi(argv[1]) > 64 || atoi(argv[2]) < 1) {
    fprintf(stderr, "usage: %s THREADS(1-64) MIB\n", argv[0]);
    return 2;
  }
  n_threads = atoi(argv[1]);
  n_floats = (size_t)atoi(argv[2]) * 1024 * 1024 / sizeof(float) / 64 * 64;
  buf = aligned_alloc(64, n_floats * sizeof(float));
  if (!buf) return 1;
  for (size_t i = 0; i < n_floats; ++i) buf[i] = 1.0f;
  pthread_barrier_init(&barrier, NULL, (unsigned)n_threads);
  pthread_t th[64];
  for (long i = 0; i < n_threads; ++i) pthread_create(&th[i], NULL, reader, (void*)i);
  for (long i = 0; i < n_threads; ++i) pthread_join(th[i], NULL);
  printf("%d thread(s), %s MiB: %.1f GB/s\n", n_threads, argv[2], n_floats * sizeof(float) / best / 1e9);
  free(buf);
  return 0;
}
