/*
 * PID 1 of every run. It reaps orphans and exits on SIGTERM, SIGINT, SIGHUP
 * or SIGQUIT (which ends the run's pid namespace). Built static by
 * build.rs so it runs in any image, even one without a libc; kept this small
 * so an idle run costs almost nothing. Waiting on any child (-1) is what a
 * PID 1 is for; nothing else in sbx does it.
 *
 * `init --seccomp <hex>`: before anything else, install the run's seccomp
 * profile, compiled once by the daemon to classic BPF (native-endian
 * struct sock_filter records, hex-encoded). The runtime has already set
 * no_new_privs. A malformed or refused filter ends the process: the run
 * fails to start rather than run unfiltered.
 */
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_INSNS 4096

static struct sock_filter insns[MAX_INSNS];

static int nibble(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

static int load_filter(const char *hex)
{
	size_t len = strlen(hex), i;
	unsigned char *out = (unsigned char *)insns;
	struct sock_fprog prog;

	if (len == 0 || len % (2 * sizeof(struct sock_filter)) != 0 ||
	    len / 2 > sizeof(insns))
		return -1;
	for (i = 0; i < len; i += 2) {
		int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);

		if (hi < 0 || lo < 0)
			return -1;
		out[i / 2] = (unsigned char)(hi << 4 | lo);
	}
	prog.len = (unsigned short)(len / 2 / sizeof(struct sock_filter));
	prog.filter = insns;
	return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

int main(int argc, char **argv)
{
	sigset_t all;
	int sig;

	if (argc == 3 && strcmp(argv[1], "--seccomp") == 0) {
		if (load_filter(argv[2]) != 0) {
			static const char msg[] = "sbx init: cannot install the seccomp filter\n";

			(void)!write(2, msg, sizeof(msg) - 1);
			_exit(126);
		}
	} else if (argc != 1) {
		_exit(125);
	}
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
