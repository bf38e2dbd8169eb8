/* The pod sandbox's pause process for the local test node (scripts/install-test-deps-node.sh):
 * registry.k8s.io/pause cannot be pulled on the test machines, so it is built here. Like the
 * upstream pause (kubernetes build/pause/linux/pause.c) it sleeps in pause() until told to
 * stop, ends on SIGINT/SIGTERM, and as a pid namespace's init it reaps orphaned children. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
	(void)sig;
	_exit(0);
}

static void reap(int sig) {
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

int main(void) {
	struct sigaction term = {.sa_handler = stop};
	struct sigaction chld = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
	sigaction(SIGINT, &term, NULL);
	sigaction(SIGTERM, &term, NULL);
	sigaction(SIGCHLD, &chld, NULL);
	for (;;)
		pause();
	return 1;
}
