/*
 * A fake libnvidia-ml.so.1 for gpukill's tests: the NVML entry points that pynvml, gpukilld and the peers
 * (gpustat, nvitop) call, with the ABI of nvml.h, answering from a JSON state file named by
 * $GPUKILL_FAKE_NVML_STATE and re-read whenever it changes. Tests load it through the real pynvml bindings.
 *
 * It claims to be driver 550 (NVML 12.550) and exports only entry points that 550's nvml.h declares: tools
 * probe for newer ones (nvitop prefers nvmlDeviceGetTemperatureV, first in the 570 header, when it is
 * present), so an extra export, even one answering NOT_SUPPORTED, makes them behave as on no real driver.
 *
 * Memory, per GPU and per MIG device, as nvml.h defines both structs: "memory_total", "memory_reserved"
 * (set aside by the driver and firmware) and "memory_allocated" (what contexts hold). nvmlMemory_v2_t reports
 * used = allocated and the reserved amount; the v1 nvmlMemory_t has no reserved field and reports
 * used = reserved + allocated; free = total - reserved - allocated in both. A process listed without
 * "used_memory" reports NVML_VALUE_NOT_AVAILABLE, written as the integer constant.
 *
 * Fault injection, per device in the state: "lost" (NVML_ERROR_GPU_IS_LOST), "reset_required",
 * "not_supported": [field, ...] (NVML_ERROR_NOT_SUPPORTED for those getters, e.g. "memory_v2": a device
 * without the v2 memory call, its MIG devices included), "slow_ms" (every call on the
 * device sleeps that long), "process_struct": "v1" (the _v2/_v3 process calls write v1-sized records, as a
 * driver with a different struct version would: the caller then reads garbage). Top level: "init_error"
 * (nvmlInit fails with that code), "driver_version", "xid_events" [{device, xid, seq}], delivered once each.
 *
 * Resource accounting: with $GPUKILL_FAKE_NVML_COUNTS set, the library rewrites that file (atomically) on every
 * nvmlInit, nvmlShutdown, nvmlEventSetCreate and nvmlEventSetFree with the running totals, one "name count"
 * a line, so a test can tell that a daemon gives back what it takes.
 *
 * Call counting: with $GPUKILL_FAKE_NVML_CALLS set, every nvml* entry point adds one to a 64-bit counter kept in
 * that file (mapped shared, so no syscall per call: the count must not cost what it measures), which a test or
 * bench reads from outside the process to tell how many NVML calls a sample makes.
 *
 * Build: cc -shared -fPIC -O2 -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10, NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_UNKNOWN = 999,
};

/* ---- a small JSON reader: objects, arrays, strings, numbers, true/false/null ---------------------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;
typedef struct jv {
    jtype t;
    double num;
    unsigned long long u; /* an integer literal, exactly (a double holds only 53 bits) */
    int is_uint;          /* u holds the number */
    char *str;
    struct jv **items;
    char **keys;
    int n;
} jv;

static const char *jp;

static void jws(void) { while (*jp == ' ' || *jp == '\n' || *jp == '\r' || *jp == '\t') jp++; }

static jv *jnew(jtype t) { jv *v = calloc(1, sizeof *v); v->t = t; return v; }

static char *jstring(void) {
    size_t cap = 16, len = 0;
    char *s = malloc(cap);
    jp++; /* opening quote */
    while (*jp && *jp != '"') {
        char c = *jp++;
        if (c == '\\' && *jp) {
            c = *jp++;
            if (c == 'n') c = '\n'; else if (c == 't') c = '\t';
            else if (c == 'u') { c = '?'; for (int i = 0; i < 4 && *jp; i++) jp++; }
        }
        if (len + 2 > cap) s = realloc(s, cap *= 2);
        s[len++] = c;
    }
    if (*jp == '"') jp++;
    s[len] = 0;
    return s;
}

static jv *jparse(void) {
    jws();
    if (*jp == '{' || *jp == '[') {
        int obj = *jp == '{';
        jv *v = jnew(obj ? J_OBJ : J_ARR);
        jp++;
        jws();
        while (*jp && *jp != (obj ? '}' : ']')) {
            char *key = NULL;
            if (obj) { key = jstring(); jws(); if (*jp == ':') jp++; }
            jv *item = jparse();
            v->items = realloc(v->items, sizeof(jv *) * (v->n + 1));
            v->keys = realloc(v->keys, sizeof(char *) * (v->n + 1));
            v->items[v->n] = item;
            v->keys[v->n] = key;
            v->n++;
            jws();
            if (*jp == ',') jp++;
            jws();
        }
        if (*jp) jp++;
        return v;
    }
    if (*jp == '"') { jv *v = jnew(J_STR); v->str = jstring(); return v; }
    if (!strncmp(jp, "true", 4)) { jp += 4; jv *v = jnew(J_BOOL); v->num = 1; return v; }
    if (!strncmp(jp, "false", 5)) { jp += 5; return jnew(J_BOOL); }
    if (!strncmp(jp, "null", 4)) { jp += 4; return jnew(J_NULL); }
    jv *v = jnew(J_NUM);
    char *end;
    const char *start = jp;
    v->num = strtod(jp, &end);
    jp = end == jp ? jp + 1 : end;
    if (*start >= '0' && *start <= '9' && !memchr(start, '.', end - start) && !memchr(start, 'e', end - start)
        && !memchr(start, 'E', end - start)) {
        v->u = strtoull(start, NULL, 10);
        v->is_uint = 1;
    }
    return v;
}

static void jfree(jv *v) {
    if (!v) return;
    for (int i = 0; i < v->n; i++) { jfree(v->items[i]); free(v->keys[i]); }
    free(v->items); free(v->keys); free(v->str); free(v);
}

static jv *jget(jv *o, const char *key) {
    if (!o || o->t != J_OBJ) return NULL;
    for (int i = 0; i < o->n; i++) if (!strcmp(o->keys[i], key)) return o->items[i];
    return NULL;
}
static double jnum(jv *o, const char *key, double dflt) { jv *v = jget(o, key); return v && (v->t == J_NUM || v->t == J_BOOL) ? v->num : dflt; }
static const char *jstr(jv *o, const char *key, const char *dflt) { jv *v = jget(o, key); return v && v->t == J_STR ? v->str : dflt; }
static int jlen(jv *a) { return a && a->t == J_ARR ? a->n : 0; }

/* NVML_VALUE_NOT_AVAILABLE ((-1) in nvml.h) in an unsigned long long field, as the integer constant: */
#define VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
/* An unsigned 64-bit field: exact for integers; `dflt` when absent, null or not a non-negative integer (a
 * double out of range would be undefined to convert, so it never is). */
static unsigned long long jull(jv *o, const char *key, unsigned long long dflt) {
    jv *v = jget(o, key);
    return v && v->t == J_NUM && v->is_uint ? v->u : dflt;
}

/* ---- state ---------------------------------------------------------------------------------------------- */

#define MAX_DEVICES 64
#define MAX_MIG 8

/* A handle is a pointer to one of these; MIG devices are handles too. */
typedef struct handle {
    int index;        /* physical GPU index */
    int mig;          /* -1 for the physical GPU, else the MIG slot */
} handle_t;

static handle_t handles[MAX_DEVICES];
static handle_t mig_handles[MAX_DEVICES][MAX_MIG];
static jv *state;
static struct timespec state_mtime;
static int initialized;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static double delivered_xid_seq = 0;
static long n_init, n_shutdown, n_event_create, n_event_free;

/* The counter file, mapped at the first call; the path is read again each call so that a process that points
 * $GPUKILL_FAKE_NVML_CALLS at another host (a test, in-process) counts there. */
static volatile uint64_t *call_counter;
static char call_counter_path[4096];
static pthread_mutex_t counter_lock = PTHREAD_MUTEX_INITIALIZER;

static void count_call(void) {
    const char *path = getenv("GPUKILL_FAKE_NVML_CALLS");
    if (!path) return;
    if (!call_counter || strcmp(path, call_counter_path)) {
        pthread_mutex_lock(&counter_lock);
        if (!call_counter || strcmp(path, call_counter_path)) {
            int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
            if (fd < 0) { pthread_mutex_unlock(&counter_lock); return; }
            struct stat st;
            if (fstat(fd, &st) == 0 && st.st_size < 8 && ftruncate(fd, 8) != 0) { close(fd); pthread_mutex_unlock(&counter_lock); return; }
            void *m = mmap(NULL, 8, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (m == MAP_FAILED) { pthread_mutex_unlock(&counter_lock); return; }
            call_counter = m; /* an old mapping is left mapped: a worker may still be adding to it */
            snprintf(call_counter_path, sizeof call_counter_path, "%s", path);
        }
        pthread_mutex_unlock(&counter_lock);
    }
    __atomic_add_fetch(call_counter, 1, __ATOMIC_RELAXED);
}

/* Called with the lock held. Written to a temporary file and renamed: a reader never sees half of it. */
static void write_counts(void) {
    const char *path = getenv("GPUKILL_FAKE_NVML_COUNTS");
    if (!path) return;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "init %ld\nshutdown %ld\nevent_set_create %ld\nevent_set_free %ld\n",
            n_init, n_shutdown, n_event_create, n_event_free);
    fclose(f);
    rename(tmp, path);
}

/* Called with the lock held: one more of *counter, in the totals of the host $GPUKILL_FAKE_NVML_COUNTS names now.
 * The totals start again from zero when that path changes, because a test process that loads the library once
 * and points it at one host after another must not see an earlier host's calls in a later host's file. */
static char counts_path[4096];
static void count_event(long *counter) {
    const char *path = getenv("GPUKILL_FAKE_NVML_COUNTS");
    if (path && strcmp(path, counts_path)) {
        n_init = n_shutdown = n_event_create = n_event_free = 0;
        snprintf(counts_path, sizeof counts_path, "%s", path);
    }
    ++*counter;
    write_counts();
}

static void reload(void) {
    const char *path = getenv("GPUKILL_FAKE_NVML_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) return;
    if (state && st.st_mtim.tv_sec == state_mtime.tv_sec && st.st_mtim.tv_nsec == state_mtime.tv_nsec) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *buf = malloc(st.st_size + 1);
    size_t got = fread(buf, 1, st.st_size, f);
    fclose(f);
    buf[got] = 0;
    jp = buf;
    jv *fresh = jparse();
    free(buf);
    if (!fresh || fresh->t != J_OBJ) { jfree(fresh); return; } /* a half-written file: keep the old state */
    jfree(state);
    state = fresh;
    state_mtime = st.st_mtim;
}

static jv *devices(void) { return jget(state, "devices"); }

static jv *phys(handle_t *h) {
    jv *d = devices();
    return h && h->index >= 0 && h->index < jlen(d) ? d->items[h->index] : NULL;
}

static jv *dev_of(handle_t *h) {
    jv *p = phys(h);
    if (!p || h->mig < 0) return p;
    jv *migs = jget(p, "mig_devices");
    return h->mig < jlen(migs) ? migs->items[h->mig] : NULL;
}

static int has_fault(jv *p, const char *name) { jv *f = jget(jget(p, "faults"), name); return f && f->num != 0; }

static int not_supported(jv *p, const char *field) {
    jv *list = jget(jget(p, "faults"), "not_supported");
    for (int i = 0; i < jlen(list); i++)
        if (list->items[i]->t == J_STR && !strcmp(list->items[i]->str, field)) return 1;
    return 0;
}

/* Common entry for every device call: reload, check the handle, apply slow/lost/reset faults. */
static nvmlReturn_t enter(handle_t *h, jv **dev, const char *field) {
    count_call();
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    reload();
    jv *p = phys(h);
    *dev = dev_of(h);
    int slow = (int)jnum(jget(p, "faults"), "slow_ms", 0);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (!p || !*dev) ret = NVML_ERROR_INVALID_ARGUMENT;
    else if (has_fault(p, "lost")) ret = NVML_ERROR_GPU_IS_LOST;
    else if (has_fault(p, "reset_required")) ret = NVML_ERROR_RESET_REQUIRED;
    else if (field && not_supported(p, field)) ret = NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_unlock(&lock);
    if (slow > 0) usleep((useconds_t)slow * 1000); /* outside the lock: other devices keep answering */
    return ret;
}
#define ENTER(h, field)                                   \
    jv *dev;                                              \
    nvmlReturn_t _r = enter((handle_t *)(h), &dev, field); \
    if (_r != NVML_SUCCESS) return _r;

static void copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst || len == 0) return;
    snprintf(dst, len, "%s", src);
}

/* ---- init, system --------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    count_call();
    pthread_mutex_lock(&lock);
    reload();
    int err = (int)jnum(state, "init_error", 0);
    if (!state) err = NVML_ERROR_DRIVER_NOT_LOADED;
    if (!err) {
        initialized++;
        count_event(&n_init);
        for (int i = 0; i < MAX_DEVICES; i++) {
            handles[i].index = i; handles[i].mig = -1;
            for (int m = 0; m < MAX_MIG; m++) { mig_handles[i][m].index = i; mig_handles[i][m].mig = m; }
        }
    }
    pthread_mutex_unlock(&lock);
    return err;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    count_call();
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = initialized ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialized) {
        initialized--;
        count_event(&n_shutdown);
    }
    pthread_mutex_unlock(&lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    count_call();
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t system_string(const char *key, const char *dflt, char *out, unsigned int len) {
    count_call();
    pthread_mutex_lock(&lock);
    reload();
    copy_str(out, len, jstr(state, key, dflt));
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len) { return system_string("driver_version", "550.54.15", v, len); }
nvmlReturn_t nvmlSystemGetNVMLVersion(char *v, unsigned int len) { return system_string("nvml_version", "12.550.54.15", v, len); }
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { *v = 12040; return NVML_SUCCESS; }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 12040; return NVML_SUCCESS; }

nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int len) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%u/cmdline", pid);
    FILE *f = fopen(path, "r");
    if (!f) return NVML_ERROR_NOT_FOUND;
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = 0;
    copy_str(name, len, buf);
    return NVML_SUCCESS;
}

/* ---- handles -------------------------------------------------------------------------------------------- */

static nvmlReturn_t device_count(unsigned int *count) {
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    reload();
    *count = (unsigned int)jlen(devices());
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { count_call(); return device_count(count); }
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, handle_t **h) {
    unsigned int n = 0;
    count_call();
    nvmlReturn_t r = device_count(&n);
    if (r) return r;
    if (index >= n || index >= MAX_DEVICES) return NVML_ERROR_INVALID_ARGUMENT;
    *h = &handles[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, handle_t **h) { return nvmlDeviceGetHandleByIndex_v2(index, h); }

static nvmlReturn_t find_by(const char *key, const char *value, handle_t **h) {
    count_call();
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    reload();
    jv *d = devices();
    nvmlReturn_t r = NVML_ERROR_NOT_FOUND;
    for (int i = 0; i < jlen(d) && i < MAX_DEVICES; i++)
        if (value && !strcasecmp(jstr(d->items[i], key, ""), value)) { *h = &handles[i]; r = NVML_SUCCESS; break; }
    pthread_mutex_unlock(&lock);
    return r;
}
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, handle_t **h) { return find_by("uuid", uuid, h); }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, handle_t **h) { return find_by("pci_bus_id", bus, h); }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus, handle_t **h) { return find_by("pci_bus_id", bus, h); }

nvmlReturn_t nvmlDeviceGetIndex(handle_t *h, unsigned int *index) { ENTER(h, NULL); (void)dev; *index = h->index; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetMinorNumber(handle_t *h, unsigned int *minor) { ENTER(h, NULL); (void)dev; *minor = h->index; return NVML_SUCCESS; }

/* ---- identity and telemetry ----------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetName(handle_t *h, char *name, unsigned int len) {
    ENTER(h, NULL);
    copy_str(name, len, jstr(dev, "name", "NVIDIA Fake GPU"));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(handle_t *h, char *uuid, unsigned int len) {
    ENTER(h, NULL);
    copy_str(uuid, len, jstr(dev, "uuid", "GPU-00000000-0000-0000-0000-000000000000"));
    return NVML_SUCCESS;
}

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(handle_t *h, nvmlPciInfo_t *pci) {
    ENTER(h, NULL);
    const char *id = jstr(phys(h), "pci_bus_id", "00000000:00:00.0");
    memset(pci, 0, sizeof *pci);
    copy_str(pci->busId, sizeof pci->busId, id);
    copy_str(pci->busIdLegacy, sizeof pci->busIdLegacy, id + (strlen(id) > 12 ? 4 : 0));
    sscanf(id, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    pci->pciDeviceId = (unsigned int)jnum(dev, "pci_device_id", 0x233010de);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(handle_t *h, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(h, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(handle_t *h, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(h, pci); }

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
nvmlReturn_t nvmlDeviceGetUtilizationRates(handle_t *h, nvmlUtilization_t *u) {
    ENTER(h, "utilization");
    u->gpu = (unsigned int)jnum(dev, "util_gpu", 0);
    u->memory = (unsigned int)jnum(dev, "util_memory", 0);
    return NVML_SUCCESS;
}

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24))) /* NVML_STRUCT_VERSION(Memory, 2) */

/* One device's (GPU's or MIG instance's) memory in nvml.h's terms; see the top of this file. */
static void memory_of(jv *dev, unsigned long long *total, unsigned long long *reserved,
                      unsigned long long *allocated, unsigned long long *free) {
    *total = jull(dev, "memory_total", 0);
    *reserved = jull(dev, "memory_reserved", 0);
    *allocated = jull(dev, "memory_allocated", 0);
    *free = *total > *reserved + *allocated ? *total - *reserved - *allocated : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(handle_t *h, nvmlMemory_t *m) {
    ENTER(h, "memory");
    unsigned long long reserved, allocated;
    memory_of(dev, &m->total, &reserved, &allocated, &m->free);
    m->used = reserved + allocated; /* v1: "Sum of Reserved and Allocated device memory" */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(handle_t *h, nvmlMemory_v2_t *m) {
    ENTER(h, "memory_v2");
    if (m->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory_of(dev, &m->total, &m->reserved, &m->used, &m->free); /* v2: used is "Allocated device memory" */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(handle_t *h, int sensor, unsigned int *t) {
    ENTER(h, "temperature");
    if (sensor != 0 || !jget(dev, "temperature")) return NVML_ERROR_NOT_SUPPORTED;
    *t = (unsigned int)jnum(dev, "temperature", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(handle_t *h, unsigned int *mw) {
    ENTER(h, "power");
    if (!jget(dev, "power_mw")) return NVML_ERROR_NOT_SUPPORTED;
    *mw = (unsigned int)jnum(dev, "power_mw", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(handle_t *h, unsigned int *mw) {
    ENTER(h, "power_limit");
    if (!jget(dev, "power_limit_mw")) return NVML_ERROR_NOT_SUPPORTED;
    *mw = (unsigned int)jnum(dev, "power_limit_mw", 0);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(handle_t *h, unsigned int *mw) { return nvmlDeviceGetEnforcedPowerLimit(h, mw); }

/* ---- MIG ------------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetMigMode(handle_t *h, unsigned int *current, unsigned int *pending) {
    ENTER(h, "mig");
    *current = *pending = (unsigned int)jnum(dev, "mig_mode", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(handle_t *h, unsigned int *count) {
    ENTER(h, "mig");
    *count = jnum(dev, "mig_mode", 0) ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(handle_t *h, unsigned int index, handle_t **mig) {
    ENTER(h, "mig");
    if (h->mig >= 0) return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)index >= jlen(jget(dev, "mig_devices")) || index >= MAX_MIG) return NVML_ERROR_NOT_FOUND;
    *mig = &mig_handles[h->index][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(handle_t *h, unsigned int *is_mig) { *is_mig = h && h->mig >= 0; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle_t *h, handle_t **parent) {
    if (!h || h->mig < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *parent = &handles[h->index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(handle_t *h, unsigned int *id) {
    ENTER(h, NULL);
    if (h->mig < 0) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned int)jnum(dev, "gi", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(handle_t *h, unsigned int *id) {
    ENTER(h, NULL);
    if (h->mig < 0) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned int)jnum(dev, "ci", 0);
    return NVML_SUCCESS;
}

/* ---- running processes ---------------------------------------------------------------------------------- */

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_v2_t;

/* The processes of a physical GPU are its own list plus those of its MIG devices, tagged with gi/ci. */
static int gather(jv *p, const char *kind, nvmlProcessInfo_v2_t *out, int cap) {
    int n = 0;
    jv *list = jget(p, kind);
    for (int i = 0; i < jlen(list); i++, n++)
        if (n < cap) {
            jv *e = list->items[i];
            out[n].pid = (unsigned int)jnum(e, "pid", 0);
            out[n].usedGpuMemory = jull(e, "used_memory", VALUE_NOT_AVAILABLE_ULL);
            out[n].gpuInstanceId = out[n].computeInstanceId = 0xFFFFFFFF;
        }
    jv *migs = jget(p, "mig_devices");
    for (int m = 0; m < jlen(migs); m++) {
        jv *mig = migs->items[m], *ml = jget(mig, kind);
        for (int i = 0; i < jlen(ml); i++, n++)
            if (n < cap) {
                jv *e = ml->items[i];
                out[n].pid = (unsigned int)jnum(e, "pid", 0);
                out[n].usedGpuMemory = jull(e, "used_memory", VALUE_NOT_AVAILABLE_ULL);
                out[n].gpuInstanceId = (unsigned int)jnum(mig, "gi", 0);
                out[n].computeInstanceId = (unsigned int)jnum(mig, "ci", 0);
            }
    }
    return n;
}

static nvmlReturn_t running(handle_t *h, const char *kind, unsigned int *count, void *infos, int version) {
    ENTER(h, kind);
    jv *p = h->mig >= 0 ? dev : phys(h);
    nvmlProcessInfo_v2_t buf[512];
    int n;
    if (h->mig >= 0) { /* a MIG handle lists only its own processes */
        jv *list = jget(p, kind);
        n = 0;
        for (int i = 0; i < jlen(list) && i < 512; i++, n++) {
            buf[n].pid = (unsigned int)jnum(list->items[i], "pid", 0);
            buf[n].usedGpuMemory = jull(list->items[i], "used_memory", VALUE_NOT_AVAILABLE_ULL);
            buf[n].gpuInstanceId = (unsigned int)jnum(p, "gi", 0);
            buf[n].computeInstanceId = (unsigned int)jnum(p, "ci", 0);
        }
    } else {
        n = gather(p, kind, buf, 512);
    }
    if (n == 0) { *count = 0; return NVML_SUCCESS; }
    if (!infos || *count < (unsigned int)n) { *count = (unsigned int)n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    const char *layout = jstr(jget(phys(h), "faults"), "process_struct", "");
    if (version == 1 || !strcmp(layout, "v1")) { /* v1 records; into a v2/v3 buffer they are garbage */
        nvmlProcessInfo_v1_t *o = infos;
        for (int i = 0; i < n; i++) { o[i].pid = buf[i].pid; o[i].usedGpuMemory = buf[i].usedGpuMemory; }
    } else {
        memcpy(infos, buf, sizeof(nvmlProcessInfo_v2_t) * n);
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

#define RUNNING(name, kind, version) \
    nvmlReturn_t name(handle_t *h, unsigned int *count, void *infos) { return running(h, kind, count, infos, version); }
RUNNING(nvmlDeviceGetComputeRunningProcesses, "compute", 1)
RUNNING(nvmlDeviceGetComputeRunningProcesses_v2, "compute", 2)
RUNNING(nvmlDeviceGetComputeRunningProcesses_v3, "compute", 3)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses, "graphics", 1)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v2, "graphics", 2)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v3, "graphics", 3)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses, "mps", 1)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses_v2, "mps", 2)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses_v3, "mps", 3)

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

/* Samples newer than lastSeen; NOT_FOUND when there are none, as the real library says. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(handle_t *h, nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeen) {
    ENTER(h, "process_utilization");
    jv *list = jget(dev, "process_util");
    unsigned int n = 0;
    for (int i = 0; i < jlen(list); i++)
        if (jull(list->items[i], "timestamp", 0) > lastSeen) n++;
    if (n == 0) { *count = 0; return NVML_ERROR_NOT_FOUND; }
    if (!samples || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    n = 0;
    for (int i = 0; i < jlen(list); i++) {
        jv *e = list->items[i];
        unsigned long long ts = jull(e, "timestamp", 0);
        if (ts <= lastSeen) continue;
        samples[n].pid = (unsigned int)jnum(e, "pid", 0);
        samples[n].timeStamp = ts;
        samples[n].smUtil = (unsigned int)jnum(e, "sm", 0);
        samples[n].memUtil = (unsigned int)jnum(e, "mem", 0);
        samples[n].encUtil = samples[n].decUtil = 0;
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

/* ---- events (Xid) and field values (GPU recovery action) ------------------------------------------------ */

typedef struct {
    handle_t *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

/* Each set is a real allocation, so that one never freed is a leak that valgrind or the counts show. */
nvmlReturn_t nvmlEventSetCreate(void **set) {
    count_call();
    pthread_mutex_lock(&lock);
    if (!initialized) { pthread_mutex_unlock(&lock); return NVML_ERROR_UNINITIALIZED; }
    *set = malloc(16);
    count_event(&n_event_create);
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlEventSetFree(void *set) {
    count_call();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    free(set);
    count_event(&n_event_free);
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(handle_t *h, unsigned long long types, void *set) {
    (void)types; (void)set;
    ENTER(h, "events");
    (void)dev;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetSupportedEventTypes(handle_t *h, unsigned long long *types) {
    ENTER(h, "events");
    (void)dev;
    *types = 0x8; /* Xid critical errors */
    return NVML_SUCCESS;
}

/* Deliver the next Xid event not yet delivered (by its "seq"), or time out at once. */
nvmlReturn_t nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    (void)set; (void)timeout_ms;
    count_call();
    pthread_mutex_lock(&lock);
    reload();
    jv *events = jget(state, "xid_events");
    nvmlReturn_t r = NVML_ERROR_TIMEOUT;
    for (int i = 0; i < jlen(events); i++) {
        jv *e = events->items[i];
        double seq = jnum(e, "seq", 0);
        int index = (int)jnum(e, "device", 0);
        if (seq > delivered_xid_seq && index >= 0 && index < MAX_DEVICES) {
            memset(data, 0, sizeof *data);
            data->device = &handles[index];
            data->eventType = 0x8;
            data->eventData = jull(e, "xid", 0);
            delivered_xid_seq = seq;
            r = NVML_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}
nvmlReturn_t nvmlEventSetWait(void *set, nvmlEventData_t *data, unsigned int timeout_ms) { return nvmlEventSetWait_v2(set, data, timeout_ms); }

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    unsigned long long value;
} nvmlFieldValue_t;

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
nvmlReturn_t nvmlDeviceGetFieldValues(handle_t *h, int count, nvmlFieldValue_t *values) {
    ENTER(h, NULL);
    for (int i = 0; i < count; i++) {
        values[i].valueType = 1; /* unsigned int */
        if (values[i].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && jget(dev, "recovery_action")) {
            values[i].nvmlReturn = NVML_SUCCESS;
            values[i].value = jull(dev, "recovery_action", 0);
        } else {
            values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ---- what this fake does not model: "not supported", as NVML says on devices that lack a feature --------
 * Only entry points of 550's nvml.h (not, e.g., nvmlDeviceGetTemperatureV, nvmlDeviceGetMarginTemperature,
 * nvmlDeviceGetEnforcedPowerLimit_v2 or nvmlDeviceGetDriverModel_v2, which later drivers added). */

#define UNSUPPORTED(name) nvmlReturn_t name(void) { count_call(); return NVML_ERROR_NOT_SUPPORTED; }
UNSUPPORTED(nvmlDeviceGetFanSpeed)
UNSUPPORTED(nvmlDeviceGetFanSpeed_v2)
UNSUPPORTED(nvmlDeviceGetNumFans)
UNSUPPORTED(nvmlDeviceGetClockInfo)
UNSUPPORTED(nvmlDeviceGetMaxClockInfo)
UNSUPPORTED(nvmlDeviceGetApplicationsClock)
UNSUPPORTED(nvmlDeviceGetEncoderUtilization)
UNSUPPORTED(nvmlDeviceGetDecoderUtilization)
UNSUPPORTED(nvmlDeviceGetPerformanceState)
UNSUPPORTED(nvmlDeviceGetPowerState)
UNSUPPORTED(nvmlDeviceGetPersistenceMode)
UNSUPPORTED(nvmlDeviceGetDisplayMode)
UNSUPPORTED(nvmlDeviceGetDisplayActive)
UNSUPPORTED(nvmlDeviceGetComputeMode)
UNSUPPORTED(nvmlDeviceGetEccMode)
UNSUPPORTED(nvmlDeviceGetTotalEccErrors)
UNSUPPORTED(nvmlDeviceGetBAR1MemoryInfo)
UNSUPPORTED(nvmlDeviceGetCurrPcieLinkGeneration)
UNSUPPORTED(nvmlDeviceGetCurrPcieLinkWidth)
UNSUPPORTED(nvmlDeviceGetMaxPcieLinkGeneration)
UNSUPPORTED(nvmlDeviceGetMaxPcieLinkWidth)
UNSUPPORTED(nvmlDeviceGetPcieThroughput)
UNSUPPORTED(nvmlDeviceGetTotalEnergyConsumption)
UNSUPPORTED(nvmlDeviceGetTemperatureThreshold)
UNSUPPORTED(nvmlDeviceGetSerial)
UNSUPPORTED(nvmlDeviceGetVbiosVersion)
UNSUPPORTED(nvmlDeviceGetBoardPartNumber)
UNSUPPORTED(nvmlDeviceGetBrand)
UNSUPPORTED(nvmlDeviceGetArchitecture)
UNSUPPORTED(nvmlDeviceGetCudaComputeCapability)
UNSUPPORTED(nvmlDeviceGetCurrentClocksThrottleReasons)
UNSUPPORTED(nvmlDeviceGetCurrentClocksEventReasons)
UNSUPPORTED(nvmlDeviceGetNvLinkState)
UNSUPPORTED(nvmlDeviceGetNvLinkUtilizationCounter)
UNSUPPORTED(nvmlDeviceGetProcessesUtilizationInfo)
UNSUPPORTED(nvmlDeviceGetSamples)
UNSUPPORTED(nvmlDeviceGetAccountingMode)
UNSUPPORTED(nvmlDeviceGetRetiredPages)
UNSUPPORTED(nvmlDeviceGetRemappedRows)
UNSUPPORTED(nvmlDeviceGetGspFirmwareMode)
UNSUPPORTED(nvmlDeviceGetMemoryBusWidth)
UNSUPPORTED(nvmlDeviceGetNumGpuCores)
UNSUPPORTED(nvmlDeviceGetPowerManagementMode)
UNSUPPORTED(nvmlDeviceGetPowerManagementLimitConstraints)
UNSUPPORTED(nvmlDeviceGetPowerManagementDefaultLimit)
UNSUPPORTED(nvmlDeviceGetMultiGpuBoard)
UNSUPPORTED(nvmlDeviceGetBoardId)
UNSUPPORTED(nvmlDeviceGetAttributes_v2)
UNSUPPORTED(nvmlDeviceGetVirtualizationMode)
UNSUPPORTED(nvmlDeviceGetHostVgpuMode)
UNSUPPORTED(nvmlDeviceGetC2cModeInfoV)
UNSUPPORTED(nvmlDeviceGetSupportedClocksEventReasons)
UNSUPPORTED(nvmlDeviceGetDynamicPstatesInfo)
UNSUPPORTED(nvmlDeviceGetGpuFabricInfo)
UNSUPPORTED(nvmlDeviceGetGpuFabricInfoV)
UNSUPPORTED(nvmlDeviceGetInforomVersion)
UNSUPPORTED(nvmlDeviceGetInforomImageVersion)
UNSUPPORTED(nvmlDeviceGetMemoryErrorCounter)
UNSUPPORTED(nvmlDeviceGetPcieSpeed)
UNSUPPORTED(nvmlDeviceGetPcieReplayCounter)
UNSUPPORTED(nvmlDeviceGetJpgUtilization)
UNSUPPORTED(nvmlDeviceGetOfaUtilization)
UNSUPPORTED(nvmlDeviceGetEncoderStats)
UNSUPPORTED(nvmlDeviceGetFBCStats)
UNSUPPORTED(nvmlDeviceGetMinMaxFanSpeed)
UNSUPPORTED(nvmlDeviceGetTargetFanSpeed)
UNSUPPORTED(nvmlDeviceGetClock)
UNSUPPORTED(nvmlDeviceGetGpuOperationMode)
UNSUPPORTED(nvmlDeviceGetTopologyCommonAncestor)
UNSUPPORTED(nvmlDeviceGetCpuAffinity)
UNSUPPORTED(nvmlDeviceGetMemoryAffinity)
UNSUPPORTED(nvmlDeviceGetP2PStatus)
UNSUPPORTED(nvmlDeviceGetConfComputeMemSizeInfo)
UNSUPPORTED(nvmlSystemGetConfComputeState)
UNSUPPORTED(nvmlSystemGetHicVersion)
UNSUPPORTED(nvmlUnitGetCount)
UNSUPPORTED(nvmlDeviceGetDriverModel)
/* exported by 550+ drivers, whose _v3 process records are v2-sized (tools use its presence to pick the layout) */
UNSUPPORTED(nvmlDeviceGetRunningProcessDetailList)
