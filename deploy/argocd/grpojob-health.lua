-- Argo CD health check for grpo.dev/GRPOJob (resource customization, Lua 5.1).
-- Install: deploy/argocd/argocd-cm-health.yaml, or see docs/argocd.md.
--
--   status.phase        health        why
--   (none yet)          Progressing   the operator has not reconciled the job yet
--   Pending, Starting   Progressing   pods are being scheduled / started
--   Running             Healthy       the gang trains (Progressing while a newer spec
--                                     generation is not yet observed)
--   Restarting          Progressing   a gang restart from the last checkpoint is under way
--   Suspended           Suspended     spec.runPolicy.suspend (or Kueue) removed the pods
--   Succeeded           Healthy       training completed
--   Failed              Degraded      backoff limit, permanent error, deadline...
--   anything else       Progressing   an operator newer than this check
hs = {}

local function condition(status, ctype)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype and c.status == "True" then
      return c
    end
  end
  return nil
end

local function progress_text(status)
  local p = status.progress
  if p == nil or p.step == nil then
    return ""
  end
  local text = "step " .. tostring(p.step)
  if p.maxSteps ~= nil then
    text = text .. "/" .. tostring(p.maxSteps)
  end
  if p.rewardMean ~= nil then
    text = text .. string.format(", reward %.3f", p.rewardMean)
  end
  return text
end

local function with_detail(base, detail)
  if detail == nil or detail == "" then
    return base
  end
  return base .. ": " .. detail
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the grpo-operator to reconcile the job"
  return hs
end

local phase = status.phase
local generation = obj.metadata.generation
local observed = status.observedGeneration
local stale = generation ~= nil and observed ~= nil and observed < generation

if phase == "Failed" then
  local c = condition(status, "Failed")
  hs.status = "Degraded"
  if c ~= nil then
    hs.message = with_detail("Failed (" .. (c.reason or "") .. ")", c.message)
  else
    hs.message = with_detail("Failed", status.message)
  end
elseif phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = with_detail("Succeeded", progress_text(status))
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = with_detail("Suspended", status.message)
elseif phase == "Running" and not stale then
  hs.status = "Healthy"
  hs.message = with_detail("Running", progress_text(status))
elseif phase == "Running" then
  hs.status = "Progressing"
  hs.message = "Running; waiting for the operator to observe generation " .. tostring(generation)
elseif phase == "Restarting" then
  local c = condition(status, "Restarting")
  local detail = status.message
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    detail = c.message
  end
  hs.status = "Progressing"
  hs.message = with_detail("Restarting the trainer gang (restart " .. tostring(status.restarts or 0) .. ")", detail)
elseif phase == "Pending" or phase == "Starting" then
  hs.status = "Progressing"
  hs.message = with_detail(phase, status.message)
else
  hs.status = "Progressing"
  hs.message = "Unknown phase " .. tostring(phase)
end
return hs
