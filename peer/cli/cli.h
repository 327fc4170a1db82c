/*
 * cli — the `rumor` command's subcommands. Each takes the arguments after
 * its own name (argv[0] is the subcommand name) and returns the process exit
 * status: 0 on success, 1 on a runtime failure, 2 on a usage error. Each
 * prints its own --help.
 */
#ifndef RUMOR_PEER_CLI_H
#define RUMOR_PEER_CLI_H

#include <stdbool.h>

int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_peer(int argc, char **argv);
int cmd_bootstrap(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_top(int argc, char **argv);
/* Model-parallel mode: `rumor group` starts a peer group's stages on one
 * host; `rumor peer --group G --stage s/S` is one stage (cmd_peer hands such
 * a command line to cmd_stage). */
int cmd_group(int argc, char **argv);
int cmd_stage(int argc, char **argv);
bool cmd_stage_wanted(int argc, char **argv);

#endif /* RUMOR_PEER_CLI_H */
