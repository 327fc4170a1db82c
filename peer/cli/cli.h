/*
 * cli — the `rumor` command line: argument parsing, the option tables of
 * each concern, and one file per subcommand (train, eval, peer, group,
 * bootstrap, top, keygen).
 */
#ifndef RUMOR_PEER_CLI_H
#define RUMOR_PEER_CLI_H

/* Runs `rumor` with its arguments (argv[0] is the program's name; argv[1]
 * the subcommand) and returns the process exit status: 0 on success, 1 on
 * a runtime failure, 2 on a usage error. Sets up signal handling first, so
 * it must run before any other thread starts. */
int cli_main(int argc, char **argv);

#endif /* RUMOR_PEER_CLI_H */
