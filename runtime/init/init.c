/*
 * PID 1 of every run. It reaps orphans and exits on SIGTERM, SIGINT, SIGHUP
 * or SIGQUIT (which ends the run's pid namespace). Built static by
 * build.rs so it runs in any image, even one without a libc; kept this small
 * so an idle run costs almost nothing. Waiting on any child (-1) is what a
 * PID 1 is for; nothing else in sbx does it.
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void)
{
	sigset_t all;
	int sig;

	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, NULL);
	for (;;) {
		if (sigwait(&all, &sig) != 0)
			continue;
		if (sig == SIGCHLD) {
			while (waitpid(-1, NULL, WNOHANG) > 0)
				;
		} else if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT) {
			_exit(0);
		}
	}
}
