/*
 * A stand-in libcuda.so.1 for the CUDA worker's process-structure tests
 * (agent/tests/cuda_worker.rs). It implements only what the worker reaches before its
 * first device call, and fails or misbehaves there the way a broken driver does:
 *
 *   FAKE_CUDA_MODE=nodevice (default)  cuInit returns CUDA_ERROR_NO_DEVICE (100)
 *   FAKE_CUDA_MODE=crash               cuInit aborts the process (SIGABRT)
 *   FAKE_CUDA_MODE=hang                cuInit never returns
 *
 * With FAKE_CUDA_LOG=/path, cuInit appends one line "cuInit CUDA_VISIBLE_DEVICES=<value>"
 * so a test can see which device set each worker was given.
 *
 * No CUDA header: the types are the driver API's plain C ABI (CUresult is an int enum).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NO_DEVICE 100

CUresult cuInit(unsigned int flags);
CUresult cuGetErrorString(CUresult error, const char **str);
CUresult cuGetErrorName(CUresult error, const char **str);
CUresult cuDriverGetVersion(int *version);

CUresult cuInit(unsigned int flags) {
	(void)flags;
	const char *log = getenv("FAKE_CUDA_LOG");
	if (log && *log) {
		FILE *f = fopen(log, "a");
		if (f) {
			const char *v = getenv("CUDA_VISIBLE_DEVICES");
			fprintf(f, "cuInit CUDA_VISIBLE_DEVICES=%s\n", v ? v : "");
			fclose(f);
		}
	}
	const char *mode = getenv("FAKE_CUDA_MODE");
	if (mode && strcmp(mode, "crash") == 0) abort();
	if (mode && strcmp(mode, "hang") == 0)
		for (;;) pause();
	return CUDA_ERROR_NO_DEVICE;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
	if (!str) return CUDA_ERROR_INVALID_VALUE;
	*str = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected (fake libcuda)" : "fake libcuda error";
	return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
	if (!str) return CUDA_ERROR_INVALID_VALUE;
	*str = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
	return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
	if (!version) return CUDA_ERROR_INVALID_VALUE;
	*version = 12040;
	return CUDA_SUCCESS;
}
