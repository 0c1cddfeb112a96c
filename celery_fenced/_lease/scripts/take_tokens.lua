-- take_tokens.lua: take fresh tokens for the reaper's claims and for a cancel.
--
-- KEYS[1]  token counter     <prefix>:token
-- KEYS[2]  token epoch       <prefix>:token:epoch
-- ARGV[1]  how many tokens
--
-- Returns the last of them (they run up to it), or "new-epoch", having written nothing, on a
-- server that has not begun the token epoch (begin_epoch.lua, then ask again).
if not in_token_epoch(KEYS[2]) then
  return 'new-epoch'
end
local count = tonumber(ARGV[1])
return next_tokens(KEYS[1], count)
