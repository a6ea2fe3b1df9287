# shellcheck shell=bash
# Sourced by the launch scripts: print a command as shell words, or run it.
# The caller sets dry_run=1 to print every command instead of running it.

quote() {  # shell words, quoted only where needed (readable in plans, valid for a remote shell)
  local out="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+="$word "
    elif [[ "$word" != *\'* ]]; then
      out+="'$word' "
    elif [[ "$word" != *[\$\`\"\\!]* ]]; then
      out+="\"$word\" "
    else
      out+="${word@Q} "
    fi
  done
  printf '%s' "${out% }"
}

run() {  # run COMMAND...: print it (dry run) or echo it to stderr and run it
  if [ "${dry_run:-0}" = 1 ]; then
    printf '%s\n' "$(quote "$@")"
  else
    echo "+ $(quote "$@")" >&2
    "$@"
  fi
}
