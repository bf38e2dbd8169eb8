/*
 * A fake libnvidia-ml.so.1 for tests: implements the NVML entry points taintgate's real
 * backend (validators/src/gpu/real/nvml.rs, through nvml-wrapper 0.13) calls, answering from
 * a profile file instead of a driver.
 *
 * Every type, constant and prototype comes from NVIDIA's own nvml.h (the PyPI wheel
 * nvidia-nvml-dev-cu12, installed by scripts/install-test-deps-nvidia.sh; its include
 * directory is printed by nvml-include.sh beside this file), and this file is compiled with
 * -Wall -Werror -Wmissing-prototypes: each function here must match the header's declaration,
 * and each struct handed back has the driver's layout. Every other function nvml.h declares
 * is exported too, as a weak NVML_ERROR_NOT_SUPPORTED stub generated from the header by
 * gen-stubs.py (compile.rs runs it and links its output with this file), so a program that
 * resolves all symbols up front finds them all.
 *
 * NVML_NO_UNVERSIONED_FUNC_DEFS turns off the header's `#define nvmlInit nvmlInit_v2`
 * renames and declares the legacy names, so the names below are the exported symbols, and
 * the legacy entry points the real driver still exports (nvmlInit, nvmlDeviceGetCount, ...)
 * are defined beside their versioned ones.
 *
 * Build: cc -shared -fPIC -Wall -Werror -Wmissing-prototypes -I "$(./nvml-include.sh)" \
 *            -o libnvidia-ml.so.1 fake_nvml.c nvml_stubs.c   (nvml_stubs.c from gen-stubs.py)
 *
 * The profile is read at nvmlInit: $FAKE_NVML_PROFILE if set, else `profile.txt` in the
 * directory this library was loaded from (so parallel tests each copy the library into their
 * own directory with their own profile). Format: see README.md beside this file.
 *
 * Events: `nvmlEventSetWait_v2` blocks like the real one. With nothing queued for the set it
 * waits up to `timeoutms` (polling the `xid_trigger` file in short slices) and then returns
 * NVML_ERROR_TIMEOUT. A test injects XIDs while the agent runs by writing that file.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <dlfcn.h>
#include <errno.h>
#include <nvml.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The fake's own limits (not NVML's). */
#define MAX_GPUS 16
#define MAX_MIG 7
#define MAX_KV 2048
#define MAX_EVENTS 32
/* Longest sleep between two looks at the trigger file inside one blocking wait. */
#define WAIT_SLICE_MS 20

/* What the opaque nvmlDevice_t / nvmlEventSet_t handles point at here. NVML defines no
 * layout for them (the header only declares the pointer types), so they are the fake's own. */
typedef struct fake_gpu fake_gpu;
typedef struct {
	fake_gpu *parent;
	int present;
	char uuid[96];
	char profile[32];
} fake_mig;

struct fake_gpu {
	unsigned int index;
	int lost;
	fake_mig mig[MAX_MIG];
	unsigned long long xid_events[MAX_EVENTS];
	int n_xid_events;
};

typedef struct {
	unsigned int registered; /* bitmask of GPU indexes */
} fake_event_set;

static char *keys[MAX_KV];
static char *vals[MAX_KV];
static int n_kv;
static int initialised;
static unsigned int gpu_count;
static fake_gpu gpus[MAX_GPUS];
/* Guards the XID queues and the trigger file: the agent waits on its event sets on one
 * thread while other threads may drain them. */
static pthread_mutex_t event_lock = PTHREAD_MUTEX_INITIALIZER;

static void trim(char *s) {
	size_t n = strlen(s);
	while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = 0;
}

static const char *get(const char *key) {
	for (int i = n_kv - 1; i >= 0; i--)
		if (strcmp(keys[i], key) == 0) return vals[i];
	return NULL;
}

static const char *gget(unsigned int idx, const char *field) {
	char k[128];
	snprintf(k, sizeof k, "gpu.%u.%s", idx, field);
	return get(k);
}

static unsigned long long gnum(unsigned int idx, const char *field, unsigned long long dflt) {
	const char *v = gget(idx, field);
	return v ? strtoull(v, NULL, 0) : dflt;
}

static int in_list(const char *list, unsigned long long x) {
	if (!list) return 0;
	const char *p = list;
	while (*p) {
		char *end;
		unsigned long long v = strtoull(p, &end, 0);
		if (end != p && v == x) return 1;
		p = (*end) ? end + 1 : end;
	}
	return 0;
}

/* Groups "0,1,2,3;4,5,6,7" or "all": are a and b in one group? */
static int same_group(const char *groups, unsigned int a, unsigned int b) {
	if (!groups) return 0;
	if (strcmp(groups, "all") == 0) return 1;
	char buf[1024];
	snprintf(buf, sizeof buf, "%s", groups);
	char *save = NULL;
	for (char *g = strtok_r(buf, ";", &save); g; g = strtok_r(NULL, ";", &save))
		if (in_list(g, a) && in_list(g, b)) return 1;
	return 0;
}

static const char *profile_path(char *buf, size_t len) {
	const char *env = getenv("FAKE_NVML_PROFILE");
	if (env && *env) return env;
	Dl_info info;
	if (dladdr((void *)&profile_path, &info) && info.dli_fname) {
		snprintf(buf, len, "%s", info.dli_fname);
		char *slash = strrchr(buf, '/');
		if (slash) {
			snprintf(slash + 1, len - (size_t)(slash + 1 - buf), "profile.txt");
			return buf;
		}
	}
	return "profile.txt";
}

static int load_profile(void) {
	char pbuf[4096];
	const char *path = profile_path(pbuf, sizeof pbuf);
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "fake-nvml: cannot open profile %s\n", path);
		return -1;
	}
	for (int i = 0; i < n_kv; i++) { free(keys[i]); free(vals[i]); }
	n_kv = 0;
	char line[4096];
	while (fgets(line, sizeof line, f) && n_kv < MAX_KV) {
		trim(line);
		if (line[0] == '#' || line[0] == 0) continue;
		char *eq = strchr(line, '=');
		if (!eq) continue;
		*eq = 0;
		keys[n_kv] = strdup(line);
		vals[n_kv] = strdup(eq + 1);
		n_kv++;
	}
	fclose(f);
	const char *c = get("gpus");
	gpu_count = c ? (unsigned int)strtoul(c, NULL, 0) : 0;
	if (gpu_count > MAX_GPUS) gpu_count = MAX_GPUS;
	memset(gpus, 0, sizeof gpus);
	for (unsigned int i = 0; i < gpu_count; i++) {
		gpus[i].index = i;
		gpus[i].lost = (int)gnum(i, "lost", 0);
		/* gpu.N.xid_events=79,48: queued for the event set, one per wait. */
		const char *ev = gget(i, "xid_events");
		const char *p = ev;
		while (p && *p && gpus[i].n_xid_events < MAX_EVENTS) {
			char *end;
			unsigned long long v = strtoull(p, &end, 0);
			if (end == p) break;
			gpus[i].xid_events[gpus[i].n_xid_events++] = v;
			p = (*end) ? end + 1 : end;
		}
		/* gpu.N.mig_devices=MIG-aaaa:1g.10gb,MIG-bbbb:2g.20gb */
		const char *md = gget(i, "mig_devices");
		if (md) {
			char buf[2048];
			snprintf(buf, sizeof buf, "%s", md);
			char *save = NULL;
			int m = 0;
			for (char *tok = strtok_r(buf, ",", &save); tok && m < MAX_MIG; tok = strtok_r(NULL, ",", &save), m++) {
				char *colon = strchr(tok, ':');
				gpus[i].mig[m].parent = &gpus[i];
				gpus[i].mig[m].present = 1;
				if (colon) {
					*colon = 0;
					snprintf(gpus[i].mig[m].profile, sizeof gpus[i].mig[m].profile, "%s", colon + 1);
				}
				snprintf(gpus[i].mig[m].uuid, sizeof gpus[i].mig[m].uuid, "%s", tok);
			}
		}
	}
	return 0;
}

static nvmlDevice_t gpu_handle(fake_gpu *g) { return (nvmlDevice_t)(void *)g; }

/* The GPU a handle is, or NULL (a MIG handle, or not one of ours). */
static fake_gpu *as_gpu(nvmlDevice_t d) {
	for (unsigned int i = 0; i < gpu_count; i++)
		if ((void *)d == (void *)&gpus[i]) return &gpus[i];
	return NULL;
}

/* The MIG device a handle is, or NULL. */
static fake_mig *as_mig(nvmlDevice_t d) {
	for (unsigned int i = 0; i < gpu_count; i++)
		for (int m = 0; m < MAX_MIG; m++)
			if ((void *)d == (void *)&gpus[i].mig[m]) return &gpus[i].mig[m];
	return NULL;
}

static fake_event_set *as_set(nvmlEventSet_t s) { return (fake_event_set *)(void *)s; }

/* Common guard for per-GPU queries: declares `dev` (fake_gpu *) for the handle `h`. */
#define GPU_GUARD(dev, h)                                               \
	if (!initialised) return NVML_ERROR_UNINITIALIZED;              \
	fake_gpu *dev = as_gpu(h);                                      \
	if (!dev) return NVML_ERROR_INVALID_ARGUMENT;                   \
	if (dev->lost) return NVML_ERROR_GPU_IS_LOST

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
	if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
	if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
	snprintf(dst, len, "%s", src);
	return NVML_SUCCESS;
}

/* nvmlInit/nvmlShutdown are reference counted, as in the real library: NVIDIA's device
 * plugin initialises NVML in several places (resource managers, health checker) and shuts
 * each down on its own, so a Shutdown must not end the others' session, and a nested Init
 * must not reload the profile under a thread still using it. */
static unsigned int init_refs;

static nvmlReturn_t do_init(void) {
	if (init_refs > 0) { init_refs++; return NVML_SUCCESS; }
	if (load_profile() != 0) return NVML_ERROR_UNKNOWN;
	const char *mode = get("init");
	if (mode && strcmp(mode, "driver_not_loaded") == 0) return NVML_ERROR_DRIVER_NOT_LOADED;
	if (mode && strcmp(mode, "no_permission") == 0) return NVML_ERROR_NO_PERMISSION;
	if (mode && strcmp(mode, "rm_version_mismatch") == 0) return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
	initialised = 1;
	init_refs = 1;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
nvmlReturn_t nvmlInit(void) { return do_init(); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init(); }
nvmlReturn_t nvmlShutdown(void) {
	if (init_refs == 0) return NVML_ERROR_UNINITIALIZED;
	if (--init_refs == 0) initialised = 0;
	return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
	switch (r) {
	case NVML_SUCCESS: return "Success";
	case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
	case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
	case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
	case NVML_ERROR_NOT_FOUND: return "Not Found";
	case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
	case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
	case NVML_ERROR_TIMEOUT: return "Timeout";
	case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
	case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
	case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
	default: return "Unknown Error";
	}
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	const char *v = get("driver_version");
	return copy_str(version, length, v ? v : "550.90.07");
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	if (!v) return NVML_ERROR_INVALID_ARGUMENT;
	const char *c = get("cuda_version");
	*v = c ? atoi(c) : 12040;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	if (!count) return NVML_ERROR_INVALID_ARGUMENT;
	*count = gpu_count;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	if (index >= gpu_count || !device) return NVML_ERROR_INVALID_ARGUMENT;
	if (gnum(index, "handle_lost", 0)) return NVML_ERROR_GPU_IS_LOST;
	*device = gpu_handle(&gpus[index]);
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
	return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	fake_gpu *dev = as_gpu(d);
	if (!dev || !index) return NVML_ERROR_INVALID_ARGUMENT;
	*index = dev->index;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
	fake_mig *m = as_mig(d);
	if (m) return copy_str(uuid, length, m->uuid);
	GPU_GUARD(dev, d);
	const char *v = gget(dev->index, "uuid");
	char dflt[96];
	snprintf(dflt, sizeof dflt, "GPU-00000000-0000-0000-0000-%012u", dev->index);
	return copy_str(uuid, length, v ? v : dflt);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
	fake_mig *m = as_mig(d);
	if (m) {
		char buf[128];
		snprintf(buf, sizeof buf, "NVIDIA H100 80GB HBM3 MIG %s", m->profile);
		return copy_str(name, length, buf);
	}
	GPU_GUARD(dev, d);
	const char *v = gget(dev->index, "name");
	if (!v) v = get("name");
	return copy_str(name, length, v ? v : "NVIDIA H100 80GB HBM3");
}

static void pci_of(unsigned int idx, const char *field, unsigned int dflt_bus, nvmlPciInfo_t *pci) {
	const char *v = gget(idx, field);
	unsigned int dom = 0, bus = dflt_bus, dev = 0, fn = 0;
	if (v) sscanf(v, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
	memset(pci, 0, sizeof *pci);
	pci->domain = dom;
	pci->bus = bus;
	pci->device = dev;
	pci->pciDeviceId = 0x233010de;
	snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04x:%02x:%02x.0", dom, bus, dev);
	snprintf(pci->busId, sizeof pci->busId, "%08x:%02x:%02x.0", dom, bus, dev);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
	GPU_GUARD(dev, d);
	if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
	pci_of(dev->index, "pci", 0x18 + dev->index * 0x10, pci);
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(d, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(d, pci); }

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, unsigned int *node) {
	GPU_GUARD(dev, d);
	const char *v = gget(dev->index, "numa");
	if (!v) return NVML_ERROR_NOT_SUPPORTED;
	*node = (unsigned int)strtoul(v, NULL, 0);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *mem) {
	GPU_GUARD(dev, d);
	if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
	/* Like the driver: the caller must say which layout it passed. */
	if (mem->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
	mem->total = gnum(dev->index, "memory", 85899345920ULL);
	mem->reserved = 0;
	mem->used = 0;
	mem->free = mem->total;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *mem) {
	GPU_GUARD(dev, d);
	if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
	mem->total = gnum(dev->index, "memory", 85899345920ULL);
	mem->used = 0;
	mem->free = mem->total;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t d, char *v, unsigned int length) {
	GPU_GUARD(dev, d);
	const char *s = gget(dev->index, "vbios");
	return copy_str(v, length, s ? s : "96.00.89.00.01");
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, nvmlEnableState_t *mode) {
	GPU_GUARD(dev, d);
	*mode = gnum(dev->index, "persistence", 1) ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
	GPU_GUARD(dev, d);
	*current = *pending = gnum(dev->index, "mig", 0) ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
	GPU_GUARD(dev, d);
	*count = gnum(dev->index, "mig", 0) ? MAX_MIG : 0;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *out) {
	GPU_GUARD(dev, d);
	if (index >= MAX_MIG) return NVML_ERROR_INVALID_ARGUMENT;
	if (!dev->mig[index].present) return NVML_ERROR_NOT_FOUND;
	*out = (nvmlDevice_t)(void *)&dev->mig[index];
	return NVML_SUCCESS;
}

/* gpu.N.pcie=cur_gen,max_gen,cur_width,max_width */
static void pcie_of(unsigned int idx, unsigned int out[4]) {
	out[0] = 5; out[1] = 5; out[2] = 16; out[3] = 16;
	const char *v = gget(idx, "pcie");
	if (v) sscanf(v, "%u,%u,%u,%u", &out[0], &out[1], &out[2], &out[3]);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) { GPU_GUARD(dev, d); unsigned int p[4]; pcie_of(dev->index, p); *v = p[0]; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) { GPU_GUARD(dev, d); unsigned int p[4]; pcie_of(dev->index, p); *v = p[1]; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v) { GPU_GUARD(dev, d); unsigned int p[4]; pcie_of(dev->index, p); *v = p[2]; return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v) { GPU_GUARD(dev, d); unsigned int p[4]; pcie_of(dev->index, p); *v = p[3]; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, nvmlMemoryErrorType_t errorType, nvmlEccCounterType_t counterType,
					 unsigned long long *count) {
	GPU_GUARD(dev, d);
	(void)counterType;
	*count = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? gnum(dev->index, "ecc_uncorrectable", 0) : 0;
	return NVML_SUCCESS;
}

/* Retired pages: gpu.N.retired_pages counts double-bit retirements. */
static unsigned int retired_count(unsigned int idx, nvmlPageRetirementCause_t cause) {
	return cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? (unsigned int)gnum(idx, "retired_pages", 0) : 0;
}
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, nvmlPageRetirementCause_t cause, unsigned int *count,
				       unsigned long long *addresses) {
	GPU_GUARD(dev, d);
	unsigned int have = retired_count(dev->index, cause);
	if (*count < have) { *count = have; return NVML_ERROR_INSUFFICIENT_SIZE; }
	for (unsigned int i = 0; i < have; i++) addresses[i] = 0x1000ULL * (i + 1);
	*count = have;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t d, nvmlPageRetirementCause_t cause, unsigned int *count,
					  unsigned long long *addresses, unsigned long long *timestamps) {
	GPU_GUARD(dev, d);
	unsigned int have = retired_count(dev->index, cause);
	if (*count < have) { *count = have; return NVML_ERROR_INSUFFICIENT_SIZE; }
	for (unsigned int i = 0; i < have; i++) { addresses[i] = 0x1000ULL * (i + 1); timestamps[i] = 1700000000ULL + i; }
	*count = have;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, nvmlEnableState_t *pending) {
	GPU_GUARD(dev, d);
	*pending = gnum(dev->index, "pending_retirement", 0) ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
	return NVML_SUCCESS;
}

/* gpu.N.remap=corr,unc,pending,failure ; gpu.N.remap=unsupported */
nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
				       unsigned int *failure) {
	GPU_GUARD(dev, d);
	const char *v = gget(dev->index, "remap");
	if (v && strcmp(v, "unsupported") == 0) return NVML_ERROR_NOT_SUPPORTED;
	*corr = *unc = *pending = *failure = 0;
	if (v) sscanf(v, "%u,%u,%u,%u", corr, unc, pending, failure);
	return NVML_SUCCESS;
}

/* gpu.N.fabric=absent|not_supported|not_started|in_progress|completed|failed (default: the
 * fabric= key, else absent). `absent` is NOT_SUPPORTED from the call itself (no fabric).
 * A registered GPU's place: gpu.N.fabric_cluster (32 hex digits, the UUID's bytes; default
 * the fabric_cluster= key, else zeros), gpu.N.fabric_clique (default fabric_clique=, else 0),
 * and, from the versioned call only, gpu.N.fabric_health (the health mask; default
 * fabric_health=, else 0). */
typedef struct {
	nvmlGpuFabricState_t state;
	nvmlReturn_t status;
	unsigned char cluster[NVML_GPU_FABRIC_UUID_LEN];
	unsigned int clique;
	unsigned int health;
} fake_fabric;
static nvmlReturn_t fabric_of(fake_gpu *dev, fake_fabric *f) {
	const char *v = gget(dev->index, "fabric");
	if (!v) v = get("fabric");
	if (!v || strcmp(v, "absent") == 0) return NVML_ERROR_NOT_SUPPORTED;
	memset(f, 0, sizeof *f);
	f->status = NVML_SUCCESS;
	if (strcmp(v, "not_supported") == 0) f->state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED;
	else if (strcmp(v, "not_started") == 0) f->state = NVML_GPU_FABRIC_STATE_NOT_STARTED;
	else if (strcmp(v, "in_progress") == 0) f->state = NVML_GPU_FABRIC_STATE_IN_PROGRESS;
	else if (strcmp(v, "completed") == 0) f->state = NVML_GPU_FABRIC_STATE_COMPLETED;
	else { f->state = NVML_GPU_FABRIC_STATE_COMPLETED; f->status = NVML_ERROR_UNKNOWN; }
	const char *c = gget(dev->index, "fabric_cluster");
	if (!c) c = get("fabric_cluster");
	for (int i = 0; c && i < NVML_GPU_FABRIC_UUID_LEN && c[2 * i] && c[2 * i + 1]; i++) {
		char byte[3] = {c[2 * i], c[2 * i + 1], 0};
		f->cluster[i] = (unsigned char)strtoul(byte, NULL, 16);
	}
	const char *q = get("fabric_clique");
	f->clique = (unsigned int)gnum(dev->index, "fabric_clique", q ? strtoull(q, NULL, 0) : 0);
	const char *h = get("fabric_health");
	f->health = (unsigned int)gnum(dev->index, "fabric_health", h ? strtoull(h, NULL, 0) : 0);
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t d, nvmlGpuFabricInfo_t *info) {
	GPU_GUARD(dev, d);
	if (!info) return NVML_ERROR_INVALID_ARGUMENT;
	fake_fabric f;
	nvmlReturn_t r = fabric_of(dev, &f);
	if (r != NVML_SUCCESS) return r;
	memset(info, 0, sizeof *info);
	info->state = f.state;
	info->status = f.status;
	memcpy(info->clusterUuid, f.cluster, sizeof f.cluster);
	info->cliqueId = f.clique;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, nvmlGpuFabricInfoV_t *info) {
	GPU_GUARD(dev, d);
	if (!info) return NVML_ERROR_INVALID_ARGUMENT;
	if (info->version != nvmlGpuFabricInfo_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
	fake_fabric f;
	nvmlReturn_t r = fabric_of(dev, &f);
	if (r != NVML_SUCCESS) return r;
	unsigned int version = info->version;
	memset(info, 0, sizeof *info);
	info->version = version;
	info->state = f.state;
	info->status = f.status;
	memcpy(info->clusterUuid, f.cluster, sizeof f.cluster);
	info->cliqueId = f.clique;
	info->healthMask = f.health;
	return NVML_SUCCESS;
}

/* NVLink: gpu.N.nvlinks (count, default nvlinks= key, else 18), gpu.N.nvlink_inactive=3,7,
 * gpu.N.nvlink_version (default 4), gpu.N.nvlink_remote.L (link L's far end), else
 * gpu.N.nvlink_remote (every link's), else an NVSwitch 0000:05:00.0. */
static unsigned int nvlink_count(unsigned int idx) {
	const char *g = get("nvlinks");
	return (unsigned int)gnum(idx, "nvlinks", g ? strtoull(g, NULL, 0) : 18);
}
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, nvmlEnableState_t *active) {
	GPU_GUARD(dev, d);
	if (link >= nvlink_count(dev->index)) return NVML_ERROR_NOT_SUPPORTED;
	*active = in_list(gget(dev->index, "nvlink_inactive"), link) ? NVML_FEATURE_DISABLED : NVML_FEATURE_ENABLED;
	return NVML_SUCCESS;
}
/* gpu-backend (issue 34): NVLink generation -> the header's nvmlNvlinkVersion_t. */
static unsigned int nvlink_version_enum(unsigned long long generation) {
	switch (generation) {
	case 1: return NVML_NVLINK_VERSION_1_0;
	case 2: return NVML_NVLINK_VERSION_2_0;
	case 3: return NVML_NVLINK_VERSION_3_0;
	case 4: return NVML_NVLINK_VERSION_4_0;
	case 5: return NVML_NVLINK_VERSION_5_0;
	default: return NVML_NVLINK_VERSION_INVALID;
	}
}
nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t d, unsigned int link, unsigned int *version) {
	GPU_GUARD(dev, d);
	if (link >= nvlink_count(dev->index)) return NVML_ERROR_NOT_SUPPORTED;
	/* gpu-backend (issue 34): the profile states the NVLink generation; a real driver
	 * answers an nvmlNvlinkVersion_t, so answer that (generation 4 -> NVML_NVLINK_VERSION_4_0). */
	*version = nvlink_version_enum(gnum(dev->index, "nvlink_version", 4));
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link, nvmlPciInfo_t *pci) {
	GPU_GUARD(dev, d);
	if (link >= nvlink_count(dev->index)) return NVML_ERROR_NOT_SUPPORTED;
	char field[64];
	snprintf(field, sizeof field, "nvlink_remote.%u", link);
	pci_of(dev->index, gget(dev->index, field) ? field : "nvlink_remote", 0x05, pci);
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t d, unsigned int link, nvmlPciInfo_t *pci) {
	return nvmlDeviceGetNvLinkRemotePciInfo_v2(d, link, pci);
}

/* P2P: p2p_nvlink / p2p_pcie = groups ("0,1,2,3;4,5,6,7" or "all"). Default p2p_nvlink:
 * all GPUs when they have NVLinks. */
nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t d1, nvmlDevice_t d2, nvmlGpuP2PCapsIndex_t index,
				    nvmlGpuP2PStatus_t *status) {
	GPU_GUARD(a, d1);
	GPU_GUARD(b, d2);
	const char *nv = get("p2p_nvlink");
	if (!nv && nvlink_count(a->index) > 0 && nvlink_count(b->index) > 0) nv = "all";
	int ok = index == NVML_P2P_CAPS_INDEX_NVLINK
			 ? same_group(nv, a->index, b->index)
			 : (same_group(get("p2p_pcie"), a->index, b->index) || same_group(nv, a->index, b->index));
	*status = ok ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t d1, nvmlDevice_t d2, nvmlGpuTopologyLevel_t *level) {
	GPU_GUARD(a, d1);
	GPU_GUARD(b, d2);
	/* pcie_switch groups share a switch; pcie_node groups share a CPU (across its root
	 * ports); anything else is across sockets. */
	*level = same_group(get("pcie_switch"), a->index, b->index) ? NVML_TOPOLOGY_SINGLE
		 : same_group(get("pcie_node"), a->index, b->index) ? NVML_TOPOLOGY_NODE
								     : NVML_TOPOLOGY_SYSTEM;
	return NVML_SUCCESS;
}

/* Events */
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	if (!set) return NVML_ERROR_INVALID_ARGUMENT;
	fake_event_set *s = calloc(1, sizeof *s);
	if (!s) return NVML_ERROR_MEMORY;
	*set = (nvmlEventSet_t)(void *)s;
	return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
	GPU_GUARD(dev, d);
	if (!set) return NVML_ERROR_INVALID_ARGUMENT;
	if (gnum(dev->index, "events_unsupported", 0)) return NVML_ERROR_NOT_SUPPORTED;
	if (types & nvmlEventTypeXidCriticalError) as_set(set)->registered |= 1u << dev->index;
	return NVML_SUCCESS;
}
/* Append one XID to a GPU's queue (1: queued); the caller holds event_lock. */
static int queue_xid(unsigned int gpu, unsigned long long xid, const char *from) {
	if (gpu >= gpu_count) {
		fprintf(stderr, "fake-nvml: %s: no GPU %u (the profile has %u); XID %llu dropped\n", from, gpu, gpu_count, xid);
		return 0;
	}
	if (gpus[gpu].n_xid_events >= MAX_EVENTS) {
		fprintf(stderr, "fake-nvml: %s: GPU %u queue full; XID %llu dropped\n", from, gpu, xid);
		return 0;
	}
	gpus[gpu].xid_events[gpus[gpu].n_xid_events++] = xid;
	return 1;
}

/*
 * xid_trigger=/path: when that file exists, claim it by renaming it to /path.delivered
 * (so its events are queued exactly once, and a test can see that they were), then queue
 * each `GPU_INDEX XID` line. Writers should create it atomically (write elsewhere, rename
 * into place) so a half-written file is never read. The caller holds event_lock.
 */
static void poll_trigger(unsigned int timeoutms) {
	const char *path = get("xid_trigger");
	if (!path || !*path) return;
	char claimed[4096];
	snprintf(claimed, sizeof claimed, "%s.delivered", path);
	if (rename(path, claimed) != 0) return; /* not there (yet) */
	FILE *f = fopen(claimed, "r");
	if (!f) {
		fprintf(stderr, "fake-nvml: cannot read %s: %s\n", claimed, strerror(errno));
		return;
	}
	char line[256];
	while (fgets(line, sizeof line, f)) {
		trim(line);
		if (line[0] == '#' || line[0] == 0) continue;
		unsigned int gpu;
		unsigned long long xid;
		if (sscanf(line, "%u %llu", &gpu, &xid) != 2) {
			fprintf(stderr, "fake-nvml: %s: bad line \"%s\" (want GPU_INDEX XID)\n", path, line);
			continue;
		}
		if (!queue_xid(gpu, xid, path)) continue;
		/* Tests read this back from the process's stderr: it names the timeout of the
		 * wait that was running, i.e. proof that the event arrived during a blocking wait. */
		fprintf(stderr, "fake-nvml: queued XID %llu for GPU %u from %s during a %u ms wait\n", xid, gpu, path, timeoutms);
	}
	fclose(f);
}

/* Hand the first queued XID of a GPU registered on `set` to `data`; the caller holds event_lock. */
static int pop_event(const fake_event_set *set, nvmlEventData_t *data) {
	for (unsigned int i = 0; i < gpu_count; i++) {
		if (!(set->registered & (1u << i)) || gpus[i].n_xid_events == 0) continue;
		memset(data, 0, sizeof *data);
		data->device = gpu_handle(&gpus[i]);
		data->eventType = nvmlEventTypeXidCriticalError;
		data->eventData = gpus[i].xid_events[0];
		memmove(&gpus[i].xid_events[0], &gpus[i].xid_events[1], sizeof(unsigned long long) * (size_t)(gpus[i].n_xid_events - 1));
		gpus[i].n_xid_events--;
		return 1;
	}
	return 0;
}

/*
 * The first time a wait with a non-zero timeout starts, write that timeout to
 * <xid_trigger>.armed (through a temporary name, so it is never read half-written): a test
 * waits for it before writing the trigger, knowing the process now blocks in this call.
 * The caller holds event_lock.
 */
static void arm_once(unsigned int timeoutms) {
	static int armed;
	const char *path = get("xid_trigger");
	if (armed || timeoutms == 0 || !path || !*path) return;
	armed = 1;
	char tmp[4096], dst[4096];
	snprintf(tmp, sizeof tmp, "%s.armed.tmp", path);
	snprintf(dst, sizeof dst, "%s.armed", path);
	FILE *f = fopen(tmp, "w");
	if (!f) {
		fprintf(stderr, "fake-nvml: cannot write %s: %s\n", tmp, strerror(errno));
		return;
	}
	fprintf(f, "%u\n", timeoutms);
	if (fclose(f) != 0 || rename(tmp, dst) != 0)
		fprintf(stderr, "fake-nvml: cannot write %s: %s\n", dst, strerror(errno));
}

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Like the real call: an event queued for the set returns at once; otherwise wait up to
 * `timeoutms` for one (0: do not wait) and return NVML_ERROR_TIMEOUT when none came. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t s, nvmlEventData_t *data, unsigned int timeoutms) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	fake_event_set *set = as_set(s);
	if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
	const long long deadline = now_ms() + timeoutms;
	pthread_mutex_lock(&event_lock);
	arm_once(timeoutms);
	pthread_mutex_unlock(&event_lock);
	for (;;) {
		pthread_mutex_lock(&event_lock);
		poll_trigger(timeoutms);
		int got = pop_event(set, data);
		pthread_mutex_unlock(&event_lock);
		if (got) return NVML_SUCCESS;
		long long left = deadline - now_ms();
		if (left <= 0) return NVML_ERROR_TIMEOUT;
		long long slice = left < WAIT_SLICE_MS ? left : WAIT_SLICE_MS;
		struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(slice * 1000000)};
		while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
	}
}
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
	return nvmlEventSetWait_v2(set, data, timeoutms);
}
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
	free(as_set(set));
	return NVML_SUCCESS;
}

/* ==== NVIDIA k8s device plugin and GPU Feature Discovery (tests/tests/nvidia_device_plugin.rs) ====
 * The calls the stock plugin and GFD (v0.19.1) make at start and in their health checker
 * that nvml-wrapper never needed; each answers from the profile like the ones above. */

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
	GPU_GUARD(dev, d);
	if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
	/* /dev/nvidia<minor>: the driver numbers GPUs in probe order, as the index here. */
	*minor = (unsigned int)gnum(dev->index, "minor", dev->index);
	return NVML_SUCCESS;
}

/* gpu.N.cc=9.0 (default: 9.0, Hopper, like the default H100 product name). */
nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
	GPU_GUARD(dev, d);
	if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
	const char *cc = gget(dev->index, "cc");
	*major = 9;
	*minor = 0;
	if (cc && sscanf(cc, "%d.%d", major, minor) != 2) return NVML_ERROR_UNKNOWN;
	return NVML_SUCCESS;
}

/* The health checker finds each GPU by UUID (MIG devices included). */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
	if (!initialised) return NVML_ERROR_UNINITIALIZED;
	if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
	for (unsigned int i = 0; i < gpu_count; i++) {
		char buf[96];
		if (nvmlDeviceGetUUID(gpu_handle(&gpus[i]), buf, sizeof buf) == NVML_SUCCESS && strcmp(buf, uuid) == 0) {
			if (gpus[i].lost || gnum(i, "handle_lost", 0)) return NVML_ERROR_GPU_IS_LOST;
			*device = gpu_handle(&gpus[i]);
			return NVML_SUCCESS;
		}
		for (int m = 0; m < MAX_MIG; m++)
			if (gpus[i].mig[m].present && strcmp(gpus[i].mig[m].uuid, uuid) == 0) {
				*device = (nvmlDevice_t)(void *)&gpus[i].mig[m];
				return NVML_SUCCESS;
			}
	}
	return NVML_ERROR_NOT_FOUND;
}

/* XID events on every GPU unless gpu.N.events_unsupported=1 (then NOT_SUPPORTED, which the
 * plugin takes as "too old for health checks", as on a real pre-Kepler GPU). */
nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
	GPU_GUARD(dev, d);
	if (!types) return NVML_ERROR_INVALID_ARGUMENT;
	if (gnum(dev->index, "events_unsupported", 0)) return NVML_ERROR_NOT_SUPPORTED;
	*types = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError;
	return NVML_SUCCESS;
}

/* Field values: only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is answered, from
 * gpu.N.recovery_action = none|reset|reboot|drain_p2p|drain_and_reset (the
 * nvmlDeviceGpuRecoveryAction_t values), or no_permission (the field answers
 * NVML_ERROR_NO_PERMISSION, as for an unprivileged container). Absent, or any other field:
 * that field answers NVML_ERROR_NOT_SUPPORTED, as on a driver older than 12.9. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int valuesCount, nvmlFieldValue_t *values) {
	GPU_GUARD(dev, d);
	if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
	for (int i = 0; i < valuesCount; i++) {
		nvmlFieldValue_t *f = &values[i];
		f->timestamp = 1700000000000000LL;
		f->latencyUsec = 0;
		f->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
		if (f->fieldId != NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) continue;
		const char *v = gget(dev->index, "recovery_action");
		if (!v) continue;
		if (strcmp(v, "no_permission") == 0) { f->nvmlReturn = NVML_ERROR_NO_PERMISSION; continue; }
		unsigned int action;
		if (strcmp(v, "none") == 0) action = NVML_GPU_RECOVERY_ACTION_NONE;
		else if (strcmp(v, "reset") == 0) action = NVML_GPU_RECOVERY_ACTION_GPU_RESET;
		else if (strcmp(v, "reboot") == 0) action = NVML_GPU_RECOVERY_ACTION_NODE_REBOOT;
		else if (strcmp(v, "drain_p2p") == 0) action = NVML_GPU_RECOVERY_ACTION_DRAIN_P2P;
		else if (strcmp(v, "drain_and_reset") == 0) action = NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET;
		else continue;
		f->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
		f->value.uiVal = action;
		f->nvmlReturn = NVML_SUCCESS;
	}
	return NVML_SUCCESS;
}
