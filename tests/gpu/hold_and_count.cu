// The workload of tests/gpu/test_suspend_real.py: a CUDA process that holds N GiB of device memory, filled with a
// known pattern, and counts on the GPU, so a suspend and resume can be seen from outside and checked from inside.
//
//   hold_and_count --gib N --count-file FILE
//       allocates N GiB (N may be fractional), fills it with pattern(i) for its i-th 64-bit word, then every 100 ms
//       adds one to a counter kept in device memory and writes "COUNT VERIFIED MISMATCHES" to FILE (a temporary
//       file renamed over it); once a second it compares the whole allocation with the pattern on the GPU
//       (VERIFIED: the comparisons made, MISMATCHES: the words that differed, in all). While the process is
//       suspended its CUDA calls block, so COUNT stops; after the resume it goes on from where it was, and
//       MISMATCHES stays 0 when the memory came back intact.
//   hold_and_count --alloc-only --mib M [--hold SECONDS]
//       allocates M MiB, writes to all of it, waits SECONDS (0), frees it and exits 0; exits 3 when the
//       allocation fails (printing CUDA's reason): the test's proof that memory is free for another process.
// Any other CUDA error prints it and exits 2.
//
// Build: nvcc -O2 -o hold_and_count hold_and_count.cu   (the test builds it in a temporary directory)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

#define CHECK(call)                                                                                      \
    do {                                                                                                 \
        cudaError_t err_ = (call);                                                                       \
        if (err_ != cudaSuccess) {                                                                       \
            fprintf(stderr, "hold_and_count: %s: %s\n", #call, cudaGetErrorString(err_));                \
            exit(2);                                                                                     \
        }                                                                                                \
    } while (0)

__device__ unsigned long long counter = 0;
__device__ unsigned long long mismatches = 0;

__host__ __device__ static inline unsigned long long pattern(unsigned long long i) {
    return (i + 1) * 0x9E3779B97F4A7C15ULL;  // every word differs from its neighbours and from zero
}

__global__ void fill(unsigned long long *words, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        words[i] = pattern(i);
}

__global__ void verify(const unsigned long long *words, size_t n) {
    unsigned long long bad = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        bad += words[i] != pattern(i);
    if (bad) atomicAdd(&mismatches, bad);
}

__global__ void bump() { counter++; }

static void write_count(const std::string &path, unsigned long long count, unsigned long long verified,
                        unsigned long long bad) {
    std::string tmp = path + ".tmp";
    FILE *f = fopen(tmp.c_str(), "w");
    if (!f) { perror(tmp.c_str()); exit(2); }
    fprintf(f, "%llu %llu %llu\n", count, verified, bad);
    fclose(f);
    if (rename(tmp.c_str(), path.c_str()) != 0) { perror(path.c_str()); exit(2); }
}

static int alloc_only(double mib, double hold) {
    size_t bytes = (size_t)(mib * 1024 * 1024);
    void *p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        printf("hold_and_count: could not allocate %.0f MiB: %s\n", mib, cudaGetErrorString(err));
        return 3;
    }
    CHECK(cudaMemset(p, 0x5a, bytes));
    CHECK(cudaDeviceSynchronize());
    printf("allocated %.0f MiB\n", mib);
    fflush(stdout);
    usleep((useconds_t)(hold * 1e6));
    CHECK(cudaFree(p));
    return 0;
}

int main(int argc, char **argv) {
    double gib = 1, mib = 0, hold = 0;
    bool only = false;
    std::string count_file;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        bool has_value = i + 1 < argc;
        if (a == "--gib" && has_value) gib = atof(argv[++i]);
        else if (a == "--mib" && has_value) mib = atof(argv[++i]);
        else if (a == "--hold" && has_value) hold = atof(argv[++i]);
        else if (a == "--count-file" && has_value) count_file = argv[++i];
        else if (a == "--alloc-only") only = true;
        else {
            fprintf(stderr, "usage: hold_and_count --gib N --count-file FILE | --alloc-only --mib M [--hold S]\n");
            return 64;
        }
    }
    if (only) return alloc_only(mib, hold);
    if (count_file.empty()) {
        fprintf(stderr, "hold_and_count: --count-file is required\n");
        return 64;
    }
    size_t n = (size_t)(gib * (1ULL << 30)) / sizeof(unsigned long long);
    unsigned long long *words = nullptr;
    CHECK(cudaMalloc(&words, n * sizeof *words));
    fill<<<1024, 256>>>(words, n);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    unsigned long long verified = 0, bad = 0, count = 0;
    for (unsigned long long tick = 0;; tick++) {
        bump<<<1, 1>>>();
        CHECK(cudaGetLastError());
        if (tick % 10 == 0) {
            verify<<<1024, 256>>>(words, n);
            CHECK(cudaGetLastError());
        }
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpyFromSymbol(&count, counter, sizeof count));
        if (tick % 10 == 0) {
            CHECK(cudaMemcpyFromSymbol(&bad, mismatches, sizeof bad));
            verified++;
        }
        write_count(count_file, count, verified, bad);
        usleep(100 * 1000);
    }
}
