/* A fake libascendcl.so for testing deepinfer-ascend without an NPU.
 *
 * Test seam only: this library is never shipped. It implements the subset of AscendCL that
 * the backend calls, with host memory standing in for device memory, and checks the rules
 * the backend must follow (aclInit before device use, a device set before allocating,
 * export keys closed before aclrtFree, page-aligned IPC exports, pid allow-lists, peer-access
 * flag across devices,
 * capture begin/end pairing, aclmdlRIUpdate after aclmdlRITaskSetParams).
 *
 * Compiled against the real ACL headers, so every prototype is checked against them.
 *
 * Environment (read at every call, so tests can change it at run time):
 *   DEEPINFER_FAKE_ACL_LOG           file to append one line per call: "<pid> <call> k=v ... rc=N"
 *   DEEPINFER_FAKE_ACL_FAIL          "aclrtMalloc:207001,aclrtFree:107000": fail these calls with the code
 *   DEEPINFER_FAKE_ACL_DEVICE_COUNT  devices reported by aclrtGetDeviceCount (default 2)
 *   DEEPINFER_FAKE_ACL_CANN_VERSION  version reported by aclsysGetCANNVersion (default 8.5.0)
 *
 * Device memory is POSIX shared memory (one object per aclrtMalloc) so that IPC keys can be
 * imported by another process; the export key names the object, and a sidecar object
 * "<name>.key" exists while the exporter keeps the key open and holds the pid allow-list.
 */
#define _GNU_SOURCE
#include <acl/acl_base.h>
#include <acl/acl_rt.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FAKE_API __attribute__((visibility("default")))
#define MAX_OBJECTS 4096
#define KEY_MIN_LEN 65

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static __thread int t_device = -1;
static unsigned g_seq;

/* ---------------------------------------------------------------- logging and injection */

static void log_call(const char *call, int rc, const char *fmt, ...) {
    const char *path = getenv("DEEPINFER_FAKE_ACL_LOG");
    if (!path || !*path) return;
    char line[1024];
    int n = snprintf(line, sizeof line, "%d %s", (int)getpid(), call);
    if (fmt && *fmt && n < (int)sizeof line - 2) {
        line[n++] = ' ';
        va_list ap;
        va_start(ap, fmt);
        n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
        va_end(ap);
    }
    if (n > (int)sizeof line - 32) n = (int)sizeof line - 32;
    n += snprintf(line + n, sizeof line - (size_t)n, " rc=%d\n", rc);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    ssize_t unused = write(fd, line, (size_t)n);
    (void)unused;
    close(fd);
}

/* The code DEEPINFER_FAKE_ACL_FAIL asks this call to fail with, or 0. */
static int injected(const char *call) {
    const char *spec = getenv("DEEPINFER_FAKE_ACL_FAIL");
    if (!spec) return 0;
    size_t len = strlen(call);
    for (const char *p = spec; (p = strstr(p, call)) != NULL; p += len) {
        int starts = (p == spec || p[-1] == ',');
        if (starts && p[len] == ':') return atoi(p + len + 1);
    }
    return 0;
}

#define INJECT(call)                                    \
    do {                                                \
        int code_ = injected(call);                     \
        if (code_) {                                    \
            log_call(call, code_, "injected=1");        \
            return code_;                               \
        }                                               \
    } while (0)

static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    return (v && *v) ? atoi(v) : fallback;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_us(uint64_t us) {
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---------------------------------------------------------------- object registries */

struct fake_alloc {
    void *base;
    size_t size;
    int device;
    char shm[48];
    int export_open; /* exporter holds an open IPC key on it */
};

struct fake_import {
    char key[KEY_MIN_LEN];
    void *base;
    size_t size;
};

struct fake_event {
    uint32_t flag;
    int recorded;
    uint64_t ts_ns;
};

struct fake_task {
    aclmdlRITaskType type;
    struct fake_event *event;      /* EVENT_RECORD: the event in the executable model */
    struct fake_event *pending;    /* set by aclmdlRITaskSetParams, applied by aclmdlRIUpdate */
    uint32_t record_flag;
    uint64_t kernel_us;
};

struct fake_model;

struct fake_stream {
    struct fake_model *capturing; /* model being captured into, or NULL */
    struct fake_model *owner;     /* set for the stream inside a model */
};

struct fake_model {
    struct fake_stream stream; /* the model's own stream, as aclmdlRIGetStreams reports */
    struct fake_task *tasks[MAX_OBJECTS];
    unsigned ntasks;
    int device;
    int ended;
};

static struct fake_alloc *g_allocs[MAX_OBJECTS];
static struct fake_import *g_imports[MAX_OBJECTS];
static struct fake_event *g_events[MAX_OBJECTS];
static struct fake_stream *g_streams[MAX_OBJECTS];
static struct fake_model *g_models[MAX_OBJECTS];
static struct fake_stream g_default_stream;

static int slot_add(void **table, void *obj) {
    for (int i = 0; i < MAX_OBJECTS; ++i)
        if (!table[i]) {
            table[i] = obj;
            return 1;
        }
    return 0;
}

static int slot_find(void **table, const void *obj) {
    if (!obj) return -1;
    for (int i = 0; i < MAX_OBJECTS; ++i)
        if (table[i] == obj) return i;
    return -1;
}

static struct fake_event *find_event(aclrtEvent ev) {
    int i = slot_find((void **)g_events, ev);
    return i < 0 ? NULL : g_events[i];
}

/* The stream object for a handle: NULL is the default stream; model streams are valid too. */
static struct fake_stream *find_stream(aclrtStream s) {
    if (!s) return &g_default_stream;
    if (slot_find((void **)g_streams, s) >= 0) return (struct fake_stream *)s;
    for (int i = 0; i < MAX_OBJECTS; ++i)
        if (g_models[i] && (void *)&g_models[i]->stream == s) return (struct fake_stream *)s;
    return NULL;
}

static struct fake_model *find_model(aclmdlRI m) {
    int i = slot_find((void **)g_models, m);
    return i < 0 ? NULL : g_models[i];
}

static struct fake_alloc *find_alloc_containing(const void *p) {
    for (int i = 0; i < MAX_OBJECTS; ++i) {
        struct fake_alloc *a = g_allocs[i];
        if (a && (const char *)p >= (char *)a->base && (const char *)p < (char *)a->base + a->size) return a;
    }
    return NULL;
}

static struct fake_import *find_import_containing(const void *p) {
    for (int i = 0; i < MAX_OBJECTS; ++i) {
        struct fake_import *m = g_imports[i];
        if (m && (const char *)p >= (char *)m->base && (const char *)p < (char *)m->base + m->size) return m;
    }
    return NULL;
}

#define LOCKED_RETURN(rc) \
    do {                  \
        int r_ = (rc);    \
        pthread_mutex_unlock(&g_lock); \
        return r_;        \
    } while (0)

/* ---------------------------------------------------------------- test seam */

/* Present only in this fake: tells the backend that "device" memory is host memory, so it
 * may hand it to torch as a CPU DLPack tensor. A real libascendcl.so never exports this. */
FAKE_API int deepinfer_fake_acl_host_visible(void) { return 1; }

/* Stand-in for a kernel launch (a real NPU kernel cannot run here): eagerly sleeps `us`
 * microseconds; on a capturing stream appends a KERNEL task that sleeps on replay. */
FAKE_API int deepinfer_fake_acl_launch_kernel(aclrtStream stream, uint64_t us) {
    pthread_mutex_lock(&g_lock);
    struct fake_stream *s = find_stream(stream);
    if (!s) {
        log_call("deepinfer_fake_acl_launch_kernel", ACL_ERROR_RT_PARAM_INVALID, "why=unknown-stream");
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    if (s->capturing) {
        struct fake_model *m = s->capturing;
        struct fake_task *t = calloc(1, sizeof *t);
        t->type = ACL_MODEL_RI_TASK_KERNEL;
        t->kernel_us = us;
        m->tasks[m->ntasks++] = t;
        log_call("deepinfer_fake_acl_launch_kernel", 0, "us=%llu captured=1", (unsigned long long)us);
        LOCKED_RETURN(ACL_SUCCESS);
    }
    pthread_mutex_unlock(&g_lock);
    sleep_us(us);
    log_call("deepinfer_fake_acl_launch_kernel", 0, "us=%llu captured=0", (unsigned long long)us);
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- init, devices, versions */

FAKE_API aclError aclInit(const char *configPath) {
    INJECT("aclInit");
    pthread_mutex_lock(&g_lock);
    int rc = g_initialized ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS;
    g_initialized = 1;
    log_call("aclInit", rc, "");
    LOCKED_RETURN(rc);
}

FAKE_API aclError aclFinalize(void) {
    INJECT("aclFinalize");
    g_initialized = 0;
    log_call("aclFinalize", 0, "");
    return ACL_SUCCESS;
}

FAKE_API aclError aclrtGetDeviceCount(uint32_t *count) {
    INJECT("aclrtGetDeviceCount");
    if (!count) return ACL_ERROR_INVALID_PARAM;
    *count = (uint32_t)env_int("DEEPINFER_FAKE_ACL_DEVICE_COUNT", 2);
    log_call("aclrtGetDeviceCount", 0, "count=%u", *count);
    return ACL_SUCCESS;
}

FAKE_API aclError aclrtSetDevice(int32_t deviceId) {
    INJECT("aclrtSetDevice");
    int rc = ACL_SUCCESS;
    if (!g_initialized) rc = ACL_ERROR_UNINITIALIZE;
    else if (deviceId < 0 || deviceId >= env_int("DEEPINFER_FAKE_ACL_DEVICE_COUNT", 2)) rc = ACL_ERROR_RT_INVALID_DEVICEID;
    else t_device = deviceId;
    log_call("aclrtSetDevice", rc, "device=%d", deviceId);
    return rc;
}

FAKE_API aclError aclrtGetDevice(int32_t *deviceId) {
    INJECT("aclrtGetDevice");
    if (!deviceId) return ACL_ERROR_INVALID_PARAM;
    if (t_device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *deviceId = t_device;
    return ACL_SUCCESS;
}

FAKE_API aclError aclrtResetDevice(int32_t deviceId) {
    INJECT("aclrtResetDevice");
    if (t_device == deviceId) t_device = -1;
    log_call("aclrtResetDevice", 0, "device=%d", deviceId);
    return ACL_SUCCESS;
}

FAKE_API aclError aclsysGetCANNVersion(aclCANNPackageName name, aclCANNPackageVersion *version) {
    INJECT("aclsysGetCANNVersion");
    if (!version) return ACL_ERROR_INVALID_PARAM;
    memset(version, 0, sizeof *version);
    const char *v = getenv("DEEPINFER_FAKE_ACL_CANN_VERSION");
    snprintf(version->version, sizeof version->version, "%s", (v && *v) ? v : "8.5.0");
    log_call("aclsysGetCANNVersion", 0, "name=%d version=%s", (int)name, version->version);
    return ACL_SUCCESS;
}

FAKE_API aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion) {
    INJECT("aclrtGetVersion");
    if (!majorVersion || !minorVersion || !patchVersion) return ACL_ERROR_INVALID_PARAM;
    *majorVersion = 1;
    *minorVersion = 15;
    *patchVersion = 0;
    log_call("aclrtGetVersion", 0, "");
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- memory */

FAKE_API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    INJECT("aclrtMalloc");
    if (!devPtr || size == 0) {
        log_call("aclrtMalloc", ACL_ERROR_INVALID_PARAM, "size=%zu", size);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (t_device < 0) {
        log_call("aclrtMalloc", ACL_ERROR_RT_CONTEXT_NULL, "size=%zu why=no-device-set", size);
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    pthread_mutex_lock(&g_lock);
    struct fake_alloc *a = calloc(1, sizeof *a);
    snprintf(a->shm, sizeof a->shm, "/dfacl.%d.%u", (int)getpid(), ++g_seq);
    int fd = shm_open(a->shm, O_CREAT | O_EXCL | O_RDWR, 0600);
    void *p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)size) == 0) p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (p == MAP_FAILED || !slot_add((void **)g_allocs, a)) {
        if (p != MAP_FAILED) munmap(p, size);
        shm_unlink(a->shm);
        free(a);
        log_call("aclrtMalloc", ACL_ERROR_RT_MEMORY_ALLOCATION, "size=%zu", size);
        LOCKED_RETURN(ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    a->base = p;
    a->size = size;
    a->device = t_device;
    *devPtr = p;
    log_call("aclrtMalloc", 0, "ptr=%p size=%zu device=%d policy=%d", p, size, t_device, (int)policy);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtFree(void *devPtr) {
    INJECT("aclrtFree");
    pthread_mutex_lock(&g_lock);
    int i = -1;
    for (int k = 0; k < MAX_OBJECTS; ++k)
        if (g_allocs[k] && g_allocs[k]->base == devPtr) i = k;
    if (i < 0) {
        log_call("aclrtFree", ACL_ERROR_RT_PARAM_INVALID, "ptr=%p why=not-an-allocation", devPtr);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    struct fake_alloc *a = g_allocs[i];
    if (a->export_open) {
        log_call("aclrtFree", ACL_ERROR_RT_PARAM_INVALID, "ptr=%p why=export-key-still-open", devPtr);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    munmap(a->base, a->size);
    shm_unlink(a->shm);
    g_allocs[i] = NULL;
    free(a);
    log_call("aclrtFree", 0, "ptr=%p", devPtr);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtMemGetAddressRange(void *ptr, void **pbase, size_t *psize) {
    INJECT("aclrtMemGetAddressRange");
    pthread_mutex_lock(&g_lock);
    struct fake_alloc *a = find_alloc_containing(ptr);
    struct fake_import *m = a ? NULL : find_import_containing(ptr);
    if (!a && !m) {
        log_call("aclrtMemGetAddressRange", ACL_ERROR_RT_PARAM_INVALID, "ptr=%p why=not-device-memory", ptr);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    if (pbase) *pbase = a ? a->base : m->base;
    if (psize) *psize = a ? a->size : m->size;
    log_call("aclrtMemGetAddressRange", 0, "ptr=%p base=%p", ptr, a ? a->base : m->base);
    LOCKED_RETURN(ACL_SUCCESS);
}

/* ---------------------------------------------------------------- IPC */

/* key = "<shm name>/<exporter pid>/<device>/<flags>/<size>" */
static int parse_key(const char *key, char *shm, size_t shm_len, int *pid, int *device, unsigned long *flags,
                     size_t *size) {
    const char *slash = strchr(key + 1, '/');
    if (!slash || (size_t)(slash - key) >= shm_len) return 0;
    memcpy(shm, key, (size_t)(slash - key));
    shm[slash - key] = 0;
    return sscanf(slash + 1, "%d/%d/%lu/%zu", pid, device, flags, size) == 4;
}

static void key_file_name(char *out, size_t len, const char *shm) { snprintf(out, len, "%s.key", shm); }

FAKE_API aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags) {
    INJECT("aclrtIpcMemGetExportKey");
    pthread_mutex_lock(&g_lock);
    struct fake_alloc *a = NULL;
    for (int k = 0; k < MAX_OBJECTS; ++k)
        if (g_allocs[k] && g_allocs[k]->base == devPtr) a = g_allocs[k];
    const char *why = !a ? "not-an-allocation-base" : size > a->size ? "size-exceeds-allocation"
                      : ((uintptr_t)devPtr % 4096 || size % 4096) ? "not-page-aligned"
                      : (!key || len < KEY_MIN_LEN) ? "key-buffer-too-small" : a->export_open ? "already-exported" : NULL;
    if (why) {
        log_call("aclrtIpcMemGetExportKey", ACL_ERROR_RT_PARAM_INVALID, "ptr=%p size=%zu why=%s", devPtr, size, why);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    char kf[64];
    key_file_name(kf, sizeof kf, a->shm);
    int fd = shm_open(kf, O_CREAT | O_TRUNC | O_RDWR, 0600);
    if (fd >= 0) {
        ssize_t unused = write(fd, "pids=", 5);
        (void)unused;
        close(fd);
    }
    snprintf(key, len, "%s/%d/%d/%lu/%zu", a->shm, (int)getpid(), a->device, (unsigned long)flags, size);
    a->export_open = 1;
    log_call("aclrtIpcMemGetExportKey", 0, "ptr=%p size=%zu flags=%lu key=%s", devPtr, size, (unsigned long)flags, key);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num) {
    INJECT("aclrtIpcMemSetImportPid");
    char shm[48], kf[64];
    int epid, dev;
    unsigned long flags;
    size_t size;
    if (!key || !parse_key(key, shm, sizeof shm, &epid, &dev, &flags, &size) || epid != (int)getpid() || !pid) {
        log_call("aclrtIpcMemSetImportPid", ACL_ERROR_RT_PARAM_INVALID, "key=%s", key ? key : "(null)");
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    key_file_name(kf, sizeof kf, shm);
    int fd = shm_open(kf, O_RDWR | O_APPEND, 0600);
    if (fd < 0) {
        log_call("aclrtIpcMemSetImportPid", ACL_ERROR_RT_PARAM_INVALID, "key=%s why=key-closed", key);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    char buf[512];
    int n = 0;
    for (size_t i = 0; i < num && n < (int)sizeof buf - 16; ++i) n += snprintf(buf + n, sizeof buf - (size_t)n, "%d,", pid[i]);
    off_t end = lseek(fd, 0, SEEK_END);
    ssize_t unused = pwrite(fd, buf, (size_t)n, end);
    (void)unused;
    close(fd);
    log_call("aclrtIpcMemSetImportPid", 0, "key=%s num=%zu", key, num);
    return ACL_SUCCESS;
}

static int pid_allowed(const char *kf, int me) {
    int fd = shm_open(kf, O_RDONLY, 0);
    if (fd < 0) return 0;
    char buf[1024] = {0};
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    char needle[24];
    snprintf(needle, sizeof needle, "%d,", me);
    for (char *p = buf + 5; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        if (p[-1] == '=' || p[-1] == ',') return 1;
    return 0;
}

FAKE_API aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags) {
    INJECT("aclrtIpcMemImportByKey");
    char shm[48], kf[64];
    int epid, edev;
    unsigned long eflags;
    size_t size;
    const char *why = NULL;
    if (!devPtr || !key || !parse_key(key, shm, sizeof shm, &epid, &edev, &eflags, &size)) why = "malformed-key";
    else if (t_device < 0) why = "no-device-set";
    else if (epid == (int)getpid()) why = "import-in-exporting-process";
    else if (edev != t_device && !(flags & ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)) why = "peer-device-without-peer-access-flag";
    if (!why) {
        key_file_name(kf, sizeof kf, shm);
        if (access("/dev/shm", F_OK) == 0) {
            int fd = shm_open(kf, O_RDONLY, 0);
            if (fd < 0) why = "key-closed-by-exporter";
            else close(fd);
        }
        if (!why && !(eflags & ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION) && !pid_allowed(kf, (int)getpid()))
            why = "pid-not-in-allow-list";
    }
    if (why) {
        log_call("aclrtIpcMemImportByKey", ACL_ERROR_RT_PARAM_INVALID, "key=%s flags=%lu why=%s", key ? key : "(null)",
                 (unsigned long)flags, why);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    int fd = shm_open(shm, O_RDWR, 0);
    void *p = fd >= 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (fd >= 0) close(fd);
    if (p == MAP_FAILED) {
        log_call("aclrtIpcMemImportByKey", ACL_ERROR_RT_PARAM_INVALID, "key=%s why=memory-gone", key);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    pthread_mutex_lock(&g_lock);
    struct fake_import *m = calloc(1, sizeof *m);
    snprintf(m->key, sizeof m->key, "%s", key);
    m->base = p;
    m->size = size;
    slot_add((void **)g_imports, m);
    *devPtr = p;
    log_call("aclrtIpcMemImportByKey", 0, "key=%s flags=%lu ptr=%p", key, (unsigned long)flags, p);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtIpcMemClose(const char *key) {
    INJECT("aclrtIpcMemClose");
    if (!key) return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_OBJECTS; ++i) {
        struct fake_import *m = g_imports[i];
        if (m && strcmp(m->key, key) == 0) { /* importer side: unmap */
            munmap(m->base, m->size);
            g_imports[i] = NULL;
            free(m);
            log_call("aclrtIpcMemClose", 0, "key=%s side=importer", key);
            LOCKED_RETURN(ACL_SUCCESS);
        }
    }
    char shm[48], kf[64];
    int epid, dev;
    unsigned long flags;
    size_t size;
    if (parse_key(key, shm, sizeof shm, &epid, &dev, &flags, &size) && epid == (int)getpid()) {
        for (int i = 0; i < MAX_OBJECTS; ++i) {
            struct fake_alloc *a = g_allocs[i];
            if (a && a->export_open && strcmp(a->shm, shm) == 0) { /* exporter side: destroy the key */
                key_file_name(kf, sizeof kf, shm);
                shm_unlink(kf);
                a->export_open = 0;
                log_call("aclrtIpcMemClose", 0, "key=%s side=exporter", key);
                LOCKED_RETURN(ACL_SUCCESS);
            }
        }
    }
    log_call("aclrtIpcMemClose", ACL_ERROR_RT_PARAM_INVALID, "key=%s why=unknown-key", key);
    LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
}

/* ---------------------------------------------------------------- events */

FAKE_API aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag) {
    INJECT("aclrtCreateEventWithFlag");
    if (!event) return ACL_ERROR_INVALID_PARAM;
    if (t_device < 0) {
        log_call("aclrtCreateEventWithFlag", ACL_ERROR_RT_CONTEXT_NULL, "flag=%u why=no-device-set", flag);
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    pthread_mutex_lock(&g_lock);
    struct fake_event *e = calloc(1, sizeof *e);
    e->flag = flag;
    slot_add((void **)g_events, e);
    *event = e;
    log_call("aclrtCreateEventWithFlag", 0, "event=%p flag=%u", (void *)e, flag);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtDestroyEvent(aclrtEvent event) {
    INJECT("aclrtDestroyEvent");
    pthread_mutex_lock(&g_lock);
    int i = slot_find((void **)g_events, event);
    if (i < 0) {
        log_call("aclrtDestroyEvent", ACL_ERROR_RT_PARAM_INVALID, "event=%p", event);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    free(g_events[i]);
    g_events[i] = NULL;
    log_call("aclrtDestroyEvent", 0, "event=%p", event);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    INJECT("aclrtRecordEvent");
    pthread_mutex_lock(&g_lock);
    struct fake_event *e = find_event(event);
    struct fake_stream *s = find_stream(stream);
    if (!e || !s) {
        log_call("aclrtRecordEvent", ACL_ERROR_RT_PARAM_INVALID, "event=%p stream=%p", event, stream);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    if (s->capturing) {
        struct fake_model *m = s->capturing;
        struct fake_task *t = calloc(1, sizeof *t);
        t->type = ACL_MODEL_RI_TASK_EVENT_RECORD;
        t->event = e;
        t->record_flag = (e->flag & ACL_EVENT_EXTERNAL) ? ACL_EVENT_RECORD_EXTERNAL : ACL_EVENT_RECORD_DEFAULT;
        m->tasks[m->ntasks++] = t;
        log_call("aclrtRecordEvent", 0, "event=%p stream=%p captured=1 external=%u", event, stream, t->record_flag);
        LOCKED_RETURN(ACL_SUCCESS);
    }
    e->recorded = 1;
    e->ts_ns = now_ns();
    log_call("aclrtRecordEvent", 0, "event=%p stream=%p captured=0", event, stream);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status) {
    INJECT("aclrtQueryEventStatus");
    pthread_mutex_lock(&g_lock);
    struct fake_event *e = find_event(event);
    if (!e || !status) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    *status = ACL_EVENT_RECORDED_STATUS_COMPLETE; /* work is synchronous here */
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtSynchronizeEvent(aclrtEvent event) {
    INJECT("aclrtSynchronizeEvent");
    pthread_mutex_lock(&g_lock);
    int rc = find_event(event) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    log_call("aclrtSynchronizeEvent", rc, "event=%p", event);
    LOCKED_RETURN(rc);
}

FAKE_API aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent) {
    INJECT("aclrtEventElapsedTime");
    pthread_mutex_lock(&g_lock);
    struct fake_event *a = find_event(startEvent), *b = find_event(endEvent);
    const char *why = (!a || !b || !ms) ? "unknown-event"
                      : (!(a->flag & ACL_EVENT_TIME_LINE) || !(b->flag & ACL_EVENT_TIME_LINE)) ? "no-time-line-flag"
                      : (!a->recorded || !b->recorded) ? "not-recorded" : NULL;
    if (why) {
        log_call("aclrtEventElapsedTime", ACL_ERROR_RT_PARAM_INVALID, "why=%s", why);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    *ms = (float)((double)((int64_t)(b->ts_ns - a->ts_ns)) / 1e6);
    LOCKED_RETURN(ACL_SUCCESS);
}

/* ---------------------------------------------------------------- streams */

FAKE_API aclError aclrtCreateStream(aclrtStream *stream) {
    INJECT("aclrtCreateStream");
    if (!stream) return ACL_ERROR_INVALID_PARAM;
    if (t_device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    pthread_mutex_lock(&g_lock);
    struct fake_stream *s = calloc(1, sizeof *s);
    slot_add((void **)g_streams, s);
    *stream = s;
    log_call("aclrtCreateStream", 0, "stream=%p", (void *)s);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtDestroyStream(aclrtStream stream) {
    INJECT("aclrtDestroyStream");
    pthread_mutex_lock(&g_lock);
    int i = slot_find((void **)g_streams, stream);
    if (i < 0 || g_streams[i]->capturing) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    free(g_streams[i]);
    g_streams[i] = NULL;
    log_call("aclrtDestroyStream", 0, "stream=%p", stream);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclrtSynchronizeStream(aclrtStream stream) {
    INJECT("aclrtSynchronizeStream");
    pthread_mutex_lock(&g_lock);
    int rc = find_stream(stream) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    LOCKED_RETURN(rc);
}

/* ---------------------------------------------------------------- aclmdlRI capture and replay */

FAKE_API aclError aclmdlRICaptureBegin(aclrtStream stream, aclmdlRICaptureMode mode) {
    INJECT("aclmdlRICaptureBegin");
    pthread_mutex_lock(&g_lock);
    int i = slot_find((void **)g_streams, stream);
    if (i < 0) { /* the default stream cannot be captured */
        log_call("aclmdlRICaptureBegin", ACL_ERROR_RT_PARAM_INVALID, "stream=%p why=not-a-created-stream", stream);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    struct fake_stream *s = g_streams[i];
    if (s->capturing) {
        log_call("aclmdlRICaptureBegin", ACL_ERROR_RT_STREAM_CAPTURED, "stream=%p", stream);
        LOCKED_RETURN(ACL_ERROR_RT_STREAM_CAPTURED);
    }
    struct fake_model *m = calloc(1, sizeof *m);
    m->stream.owner = m;
    m->device = t_device;
    slot_add((void **)g_models, m);
    s->capturing = m;
    log_call("aclmdlRICaptureBegin", 0, "stream=%p mode=%d model=%p", stream, (int)mode, (void *)m);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRICaptureGetInfo(aclrtStream stream, aclmdlRICaptureStatus *status, aclmdlRI *modelRI) {
    INJECT("aclmdlRICaptureGetInfo");
    pthread_mutex_lock(&g_lock);
    struct fake_stream *s = find_stream(stream);
    if (!s || !status) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    *status = s->capturing ? ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE : ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    if (modelRI) *modelRI = s->capturing;
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRICaptureEnd(aclrtStream stream, aclmdlRI *modelRI) {
    INJECT("aclmdlRICaptureEnd");
    pthread_mutex_lock(&g_lock);
    struct fake_stream *s = find_stream(stream);
    if (!s || !s->capturing || !modelRI) {
        log_call("aclmdlRICaptureEnd", ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED, "stream=%p", stream);
        LOCKED_RETURN(ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED);
    }
    struct fake_model *m = s->capturing;
    s->capturing = NULL;
    m->ended = 1;
    *modelRI = m;
    log_call("aclmdlRICaptureEnd", 0, "stream=%p model=%p tasks=%u", stream, (void *)m, m->ntasks);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRIExecuteAsync(aclmdlRI modelRI, aclrtStream stream) {
    INJECT("aclmdlRIExecuteAsync");
    pthread_mutex_lock(&g_lock);
    struct fake_model *m = find_model(modelRI);
    struct fake_stream *s = find_stream(stream);
    if (!m || !m->ended || !s || s->capturing) {
        log_call("aclmdlRIExecuteAsync", ACL_ERROR_RT_PARAM_INVALID, "model=%p stream=%p", modelRI, stream);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    log_call("aclmdlRIExecuteAsync", 0, "model=%p stream=%p", modelRI, stream);
    for (unsigned i = 0; i < m->ntasks; ++i) { /* replay in order; kernels sleep, events stamp */
        struct fake_task *t = m->tasks[i];
        if (t->type == ACL_MODEL_RI_TASK_KERNEL) {
            pthread_mutex_unlock(&g_lock);
            sleep_us(t->kernel_us);
            pthread_mutex_lock(&g_lock);
        } else if (t->type == ACL_MODEL_RI_TASK_EVENT_RECORD && find_event(t->event)) {
            t->event->recorded = 1;
            t->event->ts_ns = now_ns();
        }
    }
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRIDestroy(aclmdlRI modelRI) {
    INJECT("aclmdlRIDestroy");
    pthread_mutex_lock(&g_lock);
    int i = slot_find((void **)g_models, modelRI);
    if (i < 0) {
        log_call("aclmdlRIDestroy", ACL_ERROR_RT_PARAM_INVALID, "model=%p", modelRI);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    struct fake_model *m = g_models[i];
    for (unsigned k = 0; k < m->ntasks; ++k) free(m->tasks[k]);
    free(m);
    g_models[i] = NULL;
    log_call("aclmdlRIDestroy", 0, "model=%p", modelRI);
    LOCKED_RETURN(ACL_SUCCESS);
}

/* Older CANN releases lack the model inspection and update API: building with
 * -DDEEPINFER_FAKE_ACL_OMIT_INSPECTION leaves it out, to test how the backend says so. */
#ifndef DEEPINFER_FAKE_ACL_OMIT_INSPECTION
FAKE_API aclError aclmdlRIGetStreams(aclmdlRI modelRI, aclrtStream *streams, uint32_t *numStreams) {
    INJECT("aclmdlRIGetStreams");
    pthread_mutex_lock(&g_lock);
    struct fake_model *m = find_model(modelRI);
    if (!m || !numStreams) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    if (streams && *numStreams >= 1) streams[0] = &m->stream;
    *numStreams = 1;
    log_call("aclmdlRIGetStreams", 0, "model=%p", modelRI);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRIGetTasksByStream(aclrtStream stream, aclmdlRITask *tasks, uint32_t *numTasks) {
    INJECT("aclmdlRIGetTasksByStream");
    pthread_mutex_lock(&g_lock);
    struct fake_stream *s = find_stream(stream);
    if (!s || !s->owner || !numTasks) {
        log_call("aclmdlRIGetTasksByStream", ACL_ERROR_RT_PARAM_INVALID, "stream=%p why=not-a-model-stream", stream);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    struct fake_model *m = s->owner;
    if (tasks)
        for (uint32_t i = 0; i < *numTasks && i < m->ntasks; ++i) tasks[i] = m->tasks[i];
    *numTasks = m->ntasks;
    log_call("aclmdlRIGetTasksByStream", 0, "stream=%p tasks=%u", stream, m->ntasks);
    LOCKED_RETURN(ACL_SUCCESS);
}

static struct fake_task *find_task(aclmdlRITask task, struct fake_model **owner) {
    if (!task) return NULL;
    for (int i = 0; i < MAX_OBJECTS; ++i) {
        struct fake_model *m = g_models[i];
        if (!m) continue;
        for (unsigned k = 0; k < m->ntasks; ++k)
            if ((void *)m->tasks[k] == task) {
                if (owner) *owner = m;
                return m->tasks[k];
            }
    }
    return NULL;
}

FAKE_API aclError aclmdlRITaskGetType(aclmdlRITask task, aclmdlRITaskType *type) {
    INJECT("aclmdlRITaskGetType");
    pthread_mutex_lock(&g_lock);
    struct fake_task *t = find_task(task, NULL);
    if (!t || !type) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    *type = t->type;
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRITaskGetParams(aclmdlRITask task, aclmdlRITaskParams *params) {
    INJECT("aclmdlRITaskGetParams");
    pthread_mutex_lock(&g_lock);
    struct fake_task *t = find_task(task, NULL);
    if (!t || !params) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    memset(params, 0, sizeof *params);
    params->type = t->type;
    if (t->type == ACL_MODEL_RI_TASK_EVENT_RECORD) {
        params->eventRecordTaskParams.event = t->event;
        params->eventRecordTaskParams.eventFlag = find_event(t->event) ? t->event->flag : 0;
        params->eventRecordTaskParams.recordFlag = t->record_flag;
    }
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRITaskSetParams(aclmdlRITask task, aclmdlRITaskParams *params) {
    INJECT("aclmdlRITaskSetParams");
    pthread_mutex_lock(&g_lock);
    struct fake_task *t = find_task(task, NULL);
    if (!t || !params || params->type != t->type || t->type != ACL_MODEL_RI_TASK_EVENT_RECORD ||
        !find_event(params->eventRecordTaskParams.event)) {
        log_call("aclmdlRITaskSetParams", ACL_ERROR_RT_PARAM_INVALID, "task=%p", task);
        LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    }
    t->pending = params->eventRecordTaskParams.event;
    log_call("aclmdlRITaskSetParams", 0, "task=%p event=%p", task, (void *)t->pending);
    LOCKED_RETURN(ACL_SUCCESS);
}

FAKE_API aclError aclmdlRIUpdate(aclmdlRI modelRI) {
    INJECT("aclmdlRIUpdate");
    pthread_mutex_lock(&g_lock);
    struct fake_model *m = find_model(modelRI);
    if (!m) LOCKED_RETURN(ACL_ERROR_RT_PARAM_INVALID);
    unsigned applied = 0;
    for (unsigned k = 0; k < m->ntasks; ++k)
        if (m->tasks[k]->pending) {
            m->tasks[k]->event = m->tasks[k]->pending;
            m->tasks[k]->pending = NULL;
            ++applied;
        }
    log_call("aclmdlRIUpdate", 0, "model=%p applied=%u", modelRI, applied);
    LOCKED_RETURN(ACL_SUCCESS);
}
#endif /* DEEPINFER_FAKE_ACL_OMIT_INSPECTION */
