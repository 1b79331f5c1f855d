"""Process exit codes, shared by the training loop, the supervisor and the CLI.

=====  ==========================================================================
code   meaning
=====  ==========================================================================
0      success (training complete; command succeeded; verify PASS)
1      failure (an error; verify found a difference)
2      usage error (bad command line)
3      no valid checkpoint where one was required
75     resumable: stopped on a signal or time budget after saving -- relaunch me
=====  ==========================================================================

75 is ``EX_TEMPFAIL`` of sysexits.h: "a temporary failure; the user is invited to retry".
"""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NO_CHECKPOINT = 3
EXIT_RESUMABLE = 75
