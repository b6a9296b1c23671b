/* The floor under a pred's round trip (bench/kernel.py, the path benchmark): two processes
 * hand a turn back and forth through shared memory, the sleeping side woken by a futex or by
 * an eventfd (the rings' bells). Each round trip is two wake-ups and two sleeps, as a pred
 * on the rings is when both sides sleep; nothing else is done.
 *
 *   pingpong futex|eventfd ROUNDS   prints the run of 5 with the median wall time: its
 *                                   wall time and the CPU time of both sides, in ns a round
 *                                   trip
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void futex_wait(atomic_int *word, int value) {
    syscall(SYS_futex, word, FUTEX_WAIT, value, NULL, NULL, 0);
}

static void futex_wake(atomic_int *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* The turn goes 0 (parent's) -> 1 (child's) -> 0; each side sleeps until it is its own. */
static void futex_side(atomic_int *turn, int me, long rounds) {
    for (long i = 0; i < rounds; i++) {
        int t;
        while ((t = atomic_load(turn)) != me) futex_wait(turn, t);
        atomic_store(turn, !me);
        futex_wake(turn);
    }
}

static void eventfd_side(int mine, int theirs, int first, long rounds) {
    uint64_t one = 1, got;
    for (long i = 0; i < rounds; i++) {
        if (!(first && i == 0) && read(mine, &got, sizeof got) != sizeof got) exit(2);
        if (write(theirs, &one, sizeof one) != sizeof one) exit(2);
    }
    if (first && read(mine, &got, sizeof got) != sizeof got) exit(2);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static double cpu(int who) {
    struct rusage r;
    getrusage(who, &r);
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1e9
        + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e3;
}

typedef struct { double wall, cpu; } Run;

static Run run(int futex, long rounds) {
    atomic_int *turn = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int a = eventfd(0, 0), b = eventfd(0, 0);
    if (turn == MAP_FAILED || a < 0 || b < 0) { perror("setup"); exit(1); }
    atomic_store(turn, 0);
    double start = now(), cpu_start = cpu(RUSAGE_SELF) + cpu(RUSAGE_CHILDREN);
    pid_t child = fork();
    if (child == 0) {
        if (futex) futex_side(turn, 1, rounds);
        else eventfd_side(b, a, 0, rounds);
        _exit(0);
    }
    if (futex) futex_side(turn, 0, rounds);
    else eventfd_side(a, b, 1, rounds);
    double elapsed = now() - start;
    int status;
    waitpid(child, &status, 0);
    double spent = cpu(RUSAGE_SELF) + cpu(RUSAGE_CHILDREN) - cpu_start;
    munmap(turn, 4096);
    close(a);
    close(b);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) { fprintf(stderr, "child failed\n"); exit(1); }
    return (Run){elapsed / rounds, spent / rounds};
}

static int by_wall(const void *x, const void *y) {
    double a = ((const Run *)x)->wall, b = ((const Run *)y)->wall;
    return (a > b) - (a < b);
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "futex") && strcmp(argv[1], "eventfd"))) {
        fprintf(stderr, "usage: pingpong futex|eventfd ROUNDS\n");
        return 1;
    }
    long rounds = atol(argv[2]);
    Run runs[5];
    for (int i = 0; i < 5; i++) runs[i] = run(!strcmp(argv[1], "futex"), rounds);
    qsort(runs, 5, sizeof runs[0], by_wall);
    printf("%.0f %.0f\n", runs[2].wall, runs[2].cpu);
    return 0;
}
